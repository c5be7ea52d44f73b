"""docs/ARCHITECTURE.md stays true: every path it names exists, every checker it names is defined in the module it
names, every benchmark case it names is one of bench's, and every exercise task it names is in solutions/."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def _table_rows():
    lines = DOC[DOC.index("## Where each op lives"):].splitlines()
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if ln.startswith("| ") and "---" not in ln][1:]


def test_every_path_named_exists():
    paths = set(re.findall(r"`((?:gpullm_lessons|kernels|notebooks|solutions|exercises|tests|docs)/[\w./<>-]+)`", DOC))
    assert len(paths) > 20
    missing = [p for p in sorted(paths) if "<" not in p and not (ROOT / p.rstrip("/")).exists()]
    assert not missing, missing


def test_every_launcher_module_named_exists():
    names = set(re.findall(r"`gpullm_lessons/backends/hip/(\w+)\.py`", DOC))
    assert len(names) >= 9
    assert all((ROOT / "gpullm_lessons" / "backends" / "hip" / f"{n}.py").is_file() for n in names), names


def test_every_checker_is_defined_where_the_table_says():
    found = 0
    for row in _table_rows():
        for group in re.finditer(r"((?:`check_\w+`(?:, )?)+) \(`(checks/\w+\.py)`\)", row[4]):
            source = (ROOT / "gpullm_lessons" / group.group(2)).read_text()
            for name in re.findall(r"`(check_\w+)`", group.group(1)):
                assert re.search(rf"^(def {name}\(|{name} = _checker\()", source, re.M), \
                    f"{name} is not defined in {group.group(2)}"
                found += 1
    assert found >= 20


def test_benchmark_cases_and_tasks_exist():
    bench = (ROOT / "gpullm_lessons" / "bench" / "kernels.py").read_text()
    cases = set(re.findall(r'Case\("(\w+)"', bench))
    solutions = "".join(p.read_text() for p in (ROOT / "solutions").glob("*.ipynb"))
    tasks = set(re.findall(r"### Task (\d\d\.\d)", solutions))
    for row in _table_rows():
        case = row[5].strip("`")
        assert case == "—" or case in cases, case
        for a, b in re.findall(r"(\d\d\.\d)(?:–(\d\d\.\d))?", row[7]):
            lo, hi = a, b or a
            span = [f"{lo[:3]}{k}" for k in range(int(lo[3:]), int(hi[3:]) + 1)]
            assert set(span) <= tasks, (row[0], span)


def test_the_top_of_the_package_is_the_architecture_by_folder():
    """gpullm_lessons/ holds a dozen entries grouped by role, each named in the paragraph under the layer table; the
    grouping packages' __init__.py only list their modules (no second import path for anything)."""
    import ast

    entries = sorted(p.name for p in (ROOT / "gpullm_lessons").iterdir() if p.name not in ("__pycache__", "__init__.py",
                                                                                              "__main__.py"))
    assert len(entries) <= 15, entries
    top = DOC[DOC.index("The top of `gpullm_lessons/`"):]
    top = top[:top.index("\n\n")]
    named = [e for e in entries if f"`{e}/`" in top or f"`{e}`" in top]
    assert named == entries, f"not named under the layer table: {sorted(set(entries) - set(named))}"
    for pkg in ("model", "runtime", "bench", "checks", "classroom"):
        body = ast.parse((ROOT / "gpullm_lessons" / pkg / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{pkg}/__init__.py does more than list its modules"
        listed = ast.get_docstring(ast.Module(body=body, type_ignores=[]))
        modules = sorted(p.stem for p in (ROOT / "gpullm_lessons" / pkg).glob("*.py") if not p.stem.startswith("__"))
        missing = [m for m in modules if not re.search(rf"^\s*{m}\b", listed, re.M)]
        assert not missing, f"{pkg}/__init__.py does not list {missing}"
