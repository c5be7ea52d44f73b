"""gpullm_lessons.bench.stored: the one way lessons and library read the course's stored measurements (results/*.json)."""
import json
from pathlib import Path

import pytest

from gpullm_lessons.bench import kernels as bench, stored
from gpullm_lessons.model import checkpointing as ck

RESULTS = Path(stored.__file__).resolve().parents[1] / "results"   # gpullm_lessons/results
ON_DISK = sorted(p.stem for p in RESULTS.glob("*.json"))


def test_names_are_the_files_in_results():
    assert ON_DISK and stored.names() == ON_DISK


@pytest.mark.parametrize("name", ON_DISK)
def test_every_stored_result_loads_with_its_card_and_date(name):
    result = stored.load(name)
    assert isinstance(result, dict), name
    assert result == json.loads((RESULTS / f"{name}.json").read_text())
    assert isinstance(result.get("card"), str) and result["card"], f"{name}: no 'card'"
    assert isinstance(result.get("date"), str) and len(result["date"]) == 10, f"{name}: no ISO 'date'"
    line = stored.describe(result)
    assert line == f"the course's stored run on {result['card']}, {result['date']}"
    assert "\n" not in line


def test_load_accepts_the_file_name_too():
    assert stored.load("kernels_h100.json") == stored.load("kernels_h100")


def test_missing_name_is_none():
    assert stored.load("no_such_result_h200") is None


@pytest.mark.parametrize("bad", ["../pyproject", "results/kernels_h200", "..", "a\\b", "/etc/passwd", "x..y", ""])
def test_a_name_with_a_folder_or_dotdot_raises_naming_it(bad):
    with pytest.raises(ValueError) as e:
        stored.load(bad)
    assert repr(bad) in str(e.value)


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package of its own on sys.path, with a results/ folder: stored reads it instead of gpullm_lessons'."""
    pkg = tmp_path / "fake_stored_pkg"
    (pkg / "results").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "results" / "good_h200.json").write_text(json.dumps({"card": "Some GPU", "date": "2030-01-02"}))
    (pkg / "results" / "broken_h200.json").write_text('{"card": "Some GPU", "date": ')
    (pkg / "results" / "notes.txt").write_text("not a result")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(stored, "PACKAGE", "fake_stored_pkg")
    return pkg


def test_a_corrupt_file_raises_naming_it(fake_package):
    with pytest.raises(ValueError, match=r"broken_h200\.json"):
        stored.load("broken_h200")
    assert stored.load("good_h200") == {"card": "Some GPU", "date": "2030-01-02"}
    assert stored.names() == ["broken_h200", "good_h200"]
    assert stored.describe(stored.load("good_h200")) == "the course's stored run on Some GPU, 2030-01-02"


def test_the_library_loaders_return_what_stored_load_returns():
    assert bench.stored_kernels() == stored.load("kernels_h100")
    assert bench.stored_ceilings() == stored.load("ceilings_h200")
    assert ck.load_h200() == stored.load("checkpointing_h200")


def test_load_h200_reads_an_explicit_path(tmp_path):
    run = {"card": "Some GPU", "date": "2030-01-02", "rows": []}
    (tmp_path / "ck.json").write_text(json.dumps(run))
    assert ck.load_h200(tmp_path / "ck.json") == run
    assert ck.load_h200(str(tmp_path / "ck.json")) == run
    assert ck.load_h200(tmp_path / "missing.json") is None


def test_missing_files_keep_their_old_behaviour(monkeypatch):
    """stored_kernels/stored_ceilings raise (the lessons cannot do without them); load_h200 says None."""
    monkeypatch.setattr(stored, "load", lambda name: None)
    with pytest.raises(FileNotFoundError, match="kernels_h100"):
        bench.stored_kernels()
    with pytest.raises(FileNotFoundError, match="ceilings_h200"):
        bench.stored_ceilings()
    assert ck.load_h200() is None


def test_result_source_says_the_stored_run_in_describe_s_words():
    result = bench.stored_kernels()
    assert bench.result_source(result) == f"no live measurement: {stored.describe(result)}"
    assert bench.result_source(dict(result, live=True)).startswith(f"measured now on {result['card']}")


@pytest.mark.parametrize("name", ON_DISK)
def test_no_stored_result_is_a_run_cut_short(name):
    """`bench kernels --json` rewrites its file after each case marked "partial" (a run stopped by a time limit keeps
    what it finished); such a file is not a result to store."""
    assert not stored.load(name).get("partial"), f"{name}: a partial run (cut short); store a whole one"
