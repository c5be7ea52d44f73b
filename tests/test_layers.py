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
            yield node.lineno, mod
            for a in node.names:                  # "from . import stored" imports the module gpullm_lessons.stored
                if _is_module(f"{mod}.{a.name}"):
                    yield node.lineno, f"{mod}.{a.name}"


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
    bad = _violations(_files("gpullm_lessons/reference"), ["gpullm_lessons.reference", "gpullm_lessons.params"])
    assert not bad, "\n".join(bad)


def test_the_contracts_import_nothing_of_the_course():
    bad = _violations([ROOT / "gpullm_lessons" / "contracts.py"], [])
    assert not bad, "\n".join(bad)


def test_kernels_never_import_launchers_engine_or_checkers():
    allowed = ["gpullm_lessons.kernels", "gpullm_lessons.contracts", "gpullm_lessons.device",
               "gpullm_lessons.arrays", "gpullm_lessons.reference", "gpullm_lessons.params", "gpullm_lessons.optim"]
    bad = _violations(_files("kernels"), allowed)
    assert not bad, "\n".join(bad)


# The HIP launchers still take their argument checks from the Numba kernel modules, where those checks were first
# written. Each op's contract moves to gpullm_lessons.contracts; until then this list may only shrink.
HIP_LAUNCHERS_USING_NUMBA_MODULES = {"_hip_adamw.py", "_hip_attention.py", "_hip_convert.py", "_hip_crossentropy.py",
                                     "_hip_encoder.py", "_hip_fused.py", "_hip_layernorm.py", "_hip_linear.py"}


def test_no_new_hip_launcher_imports_a_numba_module():
    users = {f.name for f in _files("gpullm_lessons/backends") if f.name.startswith("_hip_")
             for _, mod in _imports(f) if mod.startswith("gpullm_lessons.kernels.numba")}
    assert users <= HIP_LAUNCHERS_USING_NUMBA_MODULES, f"new: {sorted(users - HIP_LAUNCHERS_USING_NUMBA_MODULES)}"
    assert users == HIP_LAUNCHERS_USING_NUMBA_MODULES, \
        f"{sorted(HIP_LAUNCHERS_USING_NUMBA_MODULES - users)} no longer import a Numba module: drop them from the list"


def test_the_walker_sees_a_planted_import(tmp_path, monkeypatch):
    pkg = tmp_path / "gpullm_lessons" / "reference"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text("import numpy as np\n\n\ndef f():\n    from ..engine import build\n    return build\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    bad = _violations([pkg / "bad.py"], ["gpullm_lessons.reference", "gpullm_lessons.params"])
    assert bad == ["gpullm_lessons/reference/bad.py:5 imports gpullm_lessons.engine"]


@pytest.mark.parametrize("text, expected", [
    ("from .rounding import mm_round", "gpullm_lessons.reference.rounding"),
    ("from .. import params", "gpullm_lessons.params"),
    ("import gpullm_lessons.contracts", "gpullm_lessons.contracts"),
])
def test_relative_imports_are_resolved(tmp_path, monkeypatch, text, expected):
    pkg = tmp_path / "gpullm_lessons" / "reference"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text(text + "\n")
    (tmp_path / "gpullm_lessons" / "params.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert expected in [mod for _, mod in _imports(pkg / "m.py")]
