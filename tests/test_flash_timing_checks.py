"""Lesson 11's timing tables show a time only for a version whose outputs matched the reference
(gpullm_lessons/checks/flash.py: checked, format_checks; NOT_VALID for stored rows).

A live result: the rows the benchmark validated keep their time, the ones it found wrong show why instead, and a row
without validation shows no time. The stored runs: the
2026-12-04 rows of v2's and v3's backward (a launch with a wrong argument list) are never shown as times, the
validated runs of 2026-12-06 keep every row."""


import pytest

from gpullm_lessons.bench import kernels as bench, profiling, stored
from gpullm_lessons.checks import flash as F

def live_result(rows):
    return {"card": "a GPU", "date": "today", "live": True, "rows": [
        {"op": op, "shape": "B1 nh2 T70 hs16", "backend": backend, "version": v, "ms": 0.1} for op, backend, v in rows]}


def test_a_live_table_shows_a_time_only_for_rows_the_benchmark_validated():
    """The benchmark validates every row before timing it (tests/test_bench_validation.py plants the wrong versions);
    the table keeps a validated row, keeps a wrong one without a time, and takes the time off a row with no
    validation rather than show it. PyTorch's row is the comparison, not a course version."""
    result = live_result([("flash_fwd_bf16", "hip", "v4"), ("flash_bwd_bf16", "hip", "v4"),
                          ("flash_bwd_bf16", "hip", "v3"), ("flash_bwd_bf16", "torch", "2.x")])
    result["rows"][0]["validation"] = {"ok": True, "max_err": 3e-3, "tol": 2e-2}
    result["rows"][1] = {k: result["rows"][1][k] for k in ("op", "shape", "backend", "version")}
    result["rows"][1]["error"] = "wrong (max err 0.5 > tol 0.02 at dq[0, 1, 5, 3])"
    checked = F.checked(result)
    rows = {(r["op"], r["version"]): r for r in checked["rows"]}
    assert rows["flash_fwd_bf16", "v4"] == result["rows"][0] and rows["flash_bwd_bf16", "v4"] == result["rows"][1]
    assert "ms" not in rows["flash_bwd_bf16", "v3"] and rows["flash_bwd_bf16", "v3"]["error"].startswith("not valid")
    assert "ms" in rows["flash_bwd_bf16", "2.x"]
    assert bench.kernel_row(checked, "flash_bwd_bf16", "hip", "v3") is None
    assert [c[2][:7] for c in checked["checks"]] == ["correct", "wrong (", "not val"]
    assert "correct (max err" in F.format_checks(checked)


def test_the_stored_v2_v3_backward_rows_of_2026_12_04_are_not_shown_as_times():
    for name in ("ncu_flash_h200",):
        run = stored.require(name)
        result = F.checked(run)
        for v in ("v2", "v3"):
            row = [r for r in result["rows"] if r["op"] == "flash_bwd_bf16" and r["version"] == v]
            assert all("ms" not in r and "duration_us" not in r for r in row), (name, v)
            assert any(c[:2] == ("flash_bwd_bf16", v) and "not valid" in c[2] for c in result["checks"])
        kept = [r for r in result["rows"] if r["op"] == "flash_bwd_bf16" and r["version"] in ("v4", "v5", "v6")]
        assert len(kept) == 3 and all("error" not in r for r in kept)
    ncu = F.checked(stored.require("ncu_flash_h200"))
    lines = profiling.format_pipes(ncu, "flash_bwd_bf16").splitlines()
    assert not any(line.split()[0] in ("v2", "v3") for line in lines[2:])
    assert "not valid" in F.format_checks(ncu)


@pytest.mark.parametrize("name", ["flash_h100", "flash_bf16_h100"])
def test_the_validated_stored_runs_keep_every_row(name):
    run = stored.require(name)
    result = F.checked(dict(run, live=False))
    assert result["rows"] == run["rows"] and result["checks"] == []
    assert all(r["status"] == "ok" and r["validation"]["ok"] for r in run["rows"])  # each checked, then timed
    assert "on a GPU this cell first checks each version" in F.format_checks(result)
