"""The layers point one way: reference -> contracts -> kernels -> launchers -> engine -> jobs. Walks every import
(module level and inside functions) of gpullm_lessons/ and kernels/ with ast, so a new import against the direction
fails here with the module and the line."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB_AND_THIRD_PARTY_OK = ("numpy", "math", "dataclasses", "contextlib", "typing", "__future__", "functools",
                             "itertools", "collections", "warnings")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":                     # shipped inside the package as gpullm_lessons.kernels
        parts = ["gpullm_lessons"] + parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(mod: str) -> bool:
    """Whether the dotted name is a module or package of ours (a file under ROOT), not a name inside one."""
    parts = mod.split(".")
    if parts[0] != "gpullm_lessons":
        return False
    rel = parts[1:]
    if rel[:1] == ["kernels"]:
        base = ROOT.joinpath("kernels", *rel[1:])
    else:
        base = ROOT.joinpath("gpullm_lessons", *rel)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path):
    """(line, imported module) for every import statement of the file, relative imports resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            modules = [f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}")]
            if len(modules) < len(node.names):    # a name defined in mod itself
                yield node.lineno, mod
            for m in modules:                     # "from ..bench import stored" imports gpullm_lessons.bench.stored
                yield node.lineno, m


def _files(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _ours(mod: str) -> bool:
    return mod == "gpullm_lessons" or mod.startswith("gpullm_lessons.")


def _violations(files, allowed):
    bad = []
    for f in files:
        for line, mod in _imports(f):
            if mod == "gpullm_lessons":           # the package itself: its __init__ only picks the device
                continue
            if _ours(mod) and not any(mod == a or mod.startswith(a + ".") for a in allowed):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    return bad


def test_the_reference_imports_only_numpy_the_parameter_layout_and_itself():
    bad = _violations(_files("gpullm_lessons/reference"), ["gpullm_lessons.reference", "gpullm_lessons.model.params"])
    assert not bad, "\n".join(bad)


def test_the_contracts_import_nothing_of_the_course_but_themselves():
    files = list(_files("gpullm_lessons/contracts"))
    assert len(files) > 1
    bad = _violations(files, ["gpullm_lessons.contracts"])
    assert not bad, "\n".join(bad)


def test_kernels_never_import_launchers_engine_or_checkers():
    allowed = ["gpullm_lessons.kernels", "gpullm_lessons.contracts", "gpullm_lessons.device",
               "gpullm_lessons.runtime.arrays", "gpullm_lessons.reference", "gpullm_lessons.model.params", "gpullm_lessons.model.optim"]
    bad = _violations(_files("kernels"), allowed)
    assert not bad, "\n".join(bad)


HIP_LAUNCHERS = "gpullm_lessons/backends/hip"   # <op>.py: an op's launchers; __init__.py collects them


def _hip_launcher_violations(files):
    """Imports of a HIP launcher module that reach a Numba module (the contract both share is in contracts) or another
    HIP launcher module (they share code only through the loader gpullm_lessons.runtime.hip and the contracts)."""
    bad = []
    for f in files:
        for line, mod in _imports(f):
            if mod.startswith("gpullm_lessons.kernels.numba"):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod} (a Numba module)")
            elif f.name != "__init__.py" and (mod == "gpullm_lessons.backends.hip"
                                               or mod.startswith("gpullm_lessons.backends.hip.")):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod} (another HIP launcher module)")
    return bad


def test_the_engine_imports_only_the_layers_below_it():
    """The engine (one GPT on a backend) sits under the jobs: it never imports the benchmarks, the checkers, the class
    tools, the plots or the training job (its NVTX ranges are engine/profiler.py's, which the benchmarks read)."""
    allowed = ["gpullm_lessons.engine", "gpullm_lessons.backends", "gpullm_lessons.contracts", "gpullm_lessons.device",
               "gpullm_lessons.kernels", "gpullm_lessons.model", "gpullm_lessons.reference", "gpullm_lessons.runtime"]
    bad = _violations(_files("gpullm_lessons/engine"), allowed)
    assert not bad, "the engine imports a layer above it:\n" + "\n".join(bad)


def test_no_hip_launcher_imports_a_numba_module_or_another_launcher():
    files = list(_files(HIP_LAUNCHERS))
    assert len(files) >= 10
    bad = _hip_launcher_violations(files)
    assert not bad, "\n".join(bad)


def test_a_planted_numba_or_launcher_import_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / HIP_LAUNCHERS
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "softmax.py").write_text("")
    (pkg / "gelu.py").write_text("from ...kernels.numba.gelu import VERSIONS\n\n\ndef f():\n"
                                 "    from .softmax import check\n    return check\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _hip_launcher_violations([pkg / "gelu.py"]) == [
        "gpullm_lessons/backends/hip/gelu.py:1 imports gpullm_lessons.kernels.numba.gelu (a Numba module)",
        "gpullm_lessons/backends/hip/gelu.py:5 imports gpullm_lessons.backends.hip.softmax (another HIP launcher module)"]


def _private_module_violations(files):
    """Imports of an underscore-private module (a._m) from outside its package folder a/ (and the folders below it)."""
    bad = []
    for f in files:
        importer = _module_name(f)
        for line, mod in _imports(f):
            if not _ours(mod) or not _is_module(mod):
                continue
            parts = mod.split(".")
            private = next((i for i, p in enumerate(parts) if p.startswith("_")), None)
            if private is None:
                continue
            home = ".".join(parts[:private])
            if not importer.startswith(home + "."):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}, private to {home}")
    return bad


def test_no_module_imports_a_private_module_of_another_package_folder():
    bad = _private_module_violations(_files("gpullm_lessons", "kernels"))
    assert not bad, "\n".join(bad)


def test_a_planted_private_import_is_found(tmp_path, monkeypatch):
    root = tmp_path / "gpullm_lessons"
    (root / "backends").mkdir(parents=True)
    (root / "backends" / "_collect.py").write_text("")
    (root / "backends" / "numba.py").write_text("from ._collect import collect\n")
    (root / "engine.py").write_text("from .backends import _collect\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _private_module_violations([root / "backends" / "numba.py", root / "engine.py"]) == [
        "gpullm_lessons/engine.py:1 imports gpullm_lessons.backends._collect, private to gpullm_lessons.backends"]


def test_the_walker_sees_a_planted_import(tmp_path, monkeypatch):
    pkg = tmp_path / "gpullm_lessons" / "reference"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text("import numpy as np\n\n\ndef f():\n    from ..engine import build\n    return build\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    bad = _violations([pkg / "bad.py"], ["gpullm_lessons.reference", "gpullm_lessons.model.params"])
    assert bad == ["gpullm_lessons/reference/bad.py:5 imports gpullm_lessons.engine"]


@pytest.mark.parametrize("text, expected", [
    ("from .rounding import mm_round", "gpullm_lessons.reference.rounding"),
    ("from ..model import params", "gpullm_lessons.model.params"),
    ("import gpullm_lessons.contracts", "gpullm_lessons.contracts"),
])
def test_relative_imports_are_resolved(tmp_path, monkeypatch, text, expected):
    pkg = tmp_path / "gpullm_lessons" / "reference"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text(text + "\n")
    (tmp_path / "gpullm_lessons" / "model").mkdir()
    (tmp_path / "gpullm_lessons" / "model" / "__init__.py").write_text("")
    (tmp_path / "gpullm_lessons" / "model" / "params.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert expected in [mod for _, mod in _imports(pkg / "m.py")]
