"""The figures package gpullm_lessons/viz/: one module per lesson, named after its notebook (viz/lNN_<name>.py for
notebooks/NN_<name>.ipynb), every name the single-file viz.py had still importable from gpullm_lessons.viz, no
module-level import of the course's own modules (so importing viz pulls in no engine, job or device), and the
figures that need no data draw headless."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from gpullm_lessons import viz

ROOT = Path(__file__).resolve().parents[1]
VIZ = ROOT / "gpullm_lessons" / "viz"
# The last commit with the single-file gpullm_lessons/viz.py; OLD_NAMES is its top-level def/class/assign names.
OLD_COMMIT = "436c629241e62f5dab5d6b03abfb2c28576711bb"
OLD_NAMES = [
    "ADAMW_TRAFFIC",
    "LiveLossPlot",
    "_cells",
    "_pyplot",
    "float_formats_html",
    "float_formats_widget",
    "plot_activation_timeline",
    "plot_adamw_bytes",
    "plot_allreduce_bandwidth",
    "plot_attention_backward_mask",
    "plot_block_reduction",
    "plot_ceilings",
    "plot_checkpoint_tradeoff",
    "plot_collectives",
    "plot_column_reduction",
    "plot_crossentropy_row_pass",
    "plot_dbias_columns",
    "plot_float_formats",
    "plot_grad_histogram",
    "plot_grid_mapping",
    "plot_layernorm_dinp_mapping",
    "plot_linear_rates",
    "plot_loss",
    "plot_loss_scale",
    "plot_param_buffer",
    "plot_precision_losses",
    "plot_ring_steps",
    "plot_roofline",
    "plot_softmax_mapping",
    "plot_step_profile",
    "plot_step_timeline",
    "plot_tiled_gemm",
    "plot_train_bench",
    "plot_training_step",
    "plot_version_fractions",
    "plot_zero_memory",
    "show_kernel",
]


def top_level_names(source: str) -> list[str]:
    """The names a module defines at its top level: def, class and assignment targets."""
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def lesson_modules():
    return sorted(p for p in VIZ.glob("l[0-9][0-9]_*.py"))


def test_every_name_of_the_old_viz_py_is_importable_from_viz():
    missing = [n for n in OLD_NAMES if not hasattr(viz, n)]
    assert not missing, f"gpullm_lessons.viz no longer exports {missing}: re-export them in viz/__init__.py"
    import gpullm_lessons.viz as by_path

    for name in OLD_NAMES:
        assert getattr(by_path, name) is getattr(viz, name)


def test_the_list_of_old_names_is_the_old_viz_py():
    """OLD_NAMES is the ast parse of viz.py at OLD_COMMIT (skipped where there is no git history, e.g. an sdist)."""
    try:
        old = subprocess.run(
            ["git", "show", f"{OLD_COMMIT}:gpullm_lessons/viz.py"], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"git not usable here: {e}")
    if old.returncode != 0:
        pytest.skip(f"no git history with {OLD_COMMIT[:7]}: {old.stderr.strip()}")
    assert sorted(top_level_names(old.stdout)) == sorted(OLD_NAMES)


def test_each_lesson_module_is_named_after_its_notebook():
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    modules = lesson_modules()
    assert modules, "no viz/lNN_<name>.py found"
    wrong = [m.name for m in modules if m.stem[1:] not in notebooks]
    assert not wrong, f"viz modules with no notebooks/NN_<name>.ipynb of the same name: {wrong}"
    others = sorted(p.name for p in VIZ.glob("*.py") if p not in modules)
    assert others == ["__init__.py", "common.py", "show.py"], (
        f"viz/ holds lesson modules, common.py, show.py (what a lesson prints of the course's code) and __init__.py: {others}"
    )


def test_every_figure_is_defined_once_and_re_exported():
    seen = {}
    for path in lesson_modules() + [VIZ / "common.py"]:
        for name in top_level_names(path.read_text()):
            assert name not in seen, f"{name} defined in {seen.get(name)} and {path.name}"
            seen[name] = path.name
            obj = getattr(viz, name, None)
            assert obj is not None, f"viz/__init__.py does not re-export {name} (from {path.name})"


def test_viz_imports_only_its_own_modules_at_module_level():
    """At module level a viz module imports the standard library, typing, and its siblings (viz.common); the course's
    modules (profiling, parallel, train, optim, checks, ...) only inside the function that draws with them."""
    bad = []
    for path in sorted(VIZ.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                continue  # a sibling: from .common import pyplot
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in ("__future__", "typing"):
                continue
            if isinstance(node, ast.Import) and all(a.name in ("os", "sys") for a in node.names):
                continue
            if (
                path.name == "show.py"
                and isinstance(node, (ast.Import, ast.ImportFrom))
                and all(
                    (getattr(node, "module", None) or a.name).split(".")[0] in ("inspect", "pathlib")
                    for a in node.names
                )
            ):
                continue  # show reads source files: the standard library's inspect and pathlib
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "module-level imports in gpullm_lessons/viz/:\n" + "\n".join(bad)


def test_importing_viz_loads_no_job_engine_or_parallel_module():
    code = (
        "import sys, gpullm_lessons.viz; "
        "print(' '.join(m for m in sys.modules if m.startswith(('gpullm_lessons.train', 'gpullm_lessons.parallel', "
        "'gpullm_lessons.engine', 'gpullm_lessons.checks.kernel_trace', 'gpullm_lessons.checks.backward', 'matplotlib', "
        "'numba', 'cupy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing gpullm_lessons.viz loaded: {out.stdout.strip()}"


@pytest.mark.parametrize(
    "name, args",
    [
        ("plot_grid_mapping", (10, 4)),
        ("plot_tiled_gemm", ()),
        ("plot_dbias_columns", ()),
        ("plot_softmax_mapping", ()),
        ("plot_block_reduction", ()),
        ("plot_layernorm_dinp_mapping", ()),
        ("plot_column_reduction", ()),
        ("plot_attention_backward_mask", ()),
        ("plot_crossentropy_row_pass", ()),
        ("plot_adamw_bytes", (3000.0,)),
        ("plot_float_formats", ()),
        ("plot_loss_scale", ([2.0**16, 2.0**15, 2.0**15], (2,))),
        ("plot_training_step", ()),
        ("plot_collectives", ()),
        ("plot_loss", ([{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "val_loss": 4.5}], None, 4.8)),
    ],
)
def test_a_figure_that_needs_no_data_draws_headless(name, args):
    plt = viz._pyplot()
    fig = getattr(viz, name)(*args)
    try:
        assert fig.axes, f"{name} drew no axes"
    finally:
        plt.close(fig)


def test_float_formats_html_is_a_table():
    html = viz.float_formats_html(0.1)
    assert "<table" in html and "bf16" in html


@pytest.mark.parametrize("vendor, warp, per_lane", [("nvidia", 32, 8), ("amd", 64, 4)])
def test_register_tile_layout_gives_every_element_one_lane_and_each_row_one_group(vendor, warp, per_lane):
    lay = viz.register_tile_layout(vendor)
    lanes = lay["lanes"]
    assert lanes.min() == 0 and lanes.max() == warp - 1 and lay["warp"] == warp
    assert all(int((lanes == lane).sum()) == per_lane for lane in range(warp))  # MMA_SE elements per lane
    assert all(len(r) == 4 for r in lay["row_lanes"])  # a row's max / sum: over 4 lanes (2 shuffles)
    # NVIDIA's accumulator pairs (c0, c1) are adjacent columns of one row: the layout of the next product's A operand
    if vendor == "nvidia":
        assert (lanes[:, 0::2] == lanes[:, 1::2]).all() and lanes[8, 0] == lanes[0, 0] == 0
    with pytest.raises(ValueError, match="vendor must be"):
        viz.register_tile_layout("intel")
