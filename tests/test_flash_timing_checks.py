"""Lesson 11's timing tables show a time only for a version whose outputs matched the reference
(gpullm_lessons/checks_flash.py: checked, version_error, format_checks; NOT_VALID for stored rows).

Without a GPU the versions are NumPy answers: the right one passes, planted mistakes (no 1/sqrt(hs), dk and dv
swapped, an output never written, an exception) are shown as "wrong (...)" in place of a time. The stored runs: the
2026-12-04 rows of v2's and v3's backward (a launch with a wrong argument list) are never shown as times, the
runs of 2026-12-03 keep every row."""

import math

import numpy as np
import pytest

from gpullm_lessons import bench, profiling, stored
from gpullm_lessons import checks_flash as F

SHAPE = (1, 2, 70, 16)  # B, nh, T, hs: T past a 64-row tile, not a multiple of it


def values(a):
    """float64 values of what a kernel is given: bf16 bits (uint16) or float32."""
    if a.dtype == np.uint16:
        import ml_dtypes

        return a.view(ml_dtypes.bfloat16).astype(np.float64)
    return a.astype(np.float64)


def forward(q, k, v, out, lse, scale=1.0):
    o, l = F.reference(values(q) * scale, values(k), values(v))
    out[...], lse[...] = o, l


def backward(q, k, v, out, dout, lse, dq, dk, dv, swap=False, skip=False):
    _, _, gq, gk, gv = F.reference(values(q), values(k), values(v), values(dout))
    dq[...] = gq
    if not skip:
        dk[...], dv[...] = (gv, gk) if swap else (gk, gv)


@pytest.mark.parametrize("op", ["flash_fwd", "flash_fwd_bf16"])
def test_the_right_forward_passes_and_a_missing_scale_is_wrong(op):
    err, where = F.version_error(op, forward, SHAPE, xp=np)
    assert err < 1e-6 and where in ("out", "lse")
    err, _ = F.version_error(op, lambda *a: forward(*a, scale=math.sqrt(SHAPE[3])), SHAPE, xp=np)
    assert err > F.TIMED_TOLERANCE["bf16"]


def test_backward_mistakes_are_wrong_and_name_the_output():
    assert F.version_error("flash_bwd_bf16", backward, SHAPE, xp=np)[0] < 1e-6
    err, where = F.version_error("flash_bwd_bf16", lambda *a: backward(*a, swap=True), SHAPE, xp=np)
    assert err > F.TIMED_TOLERANCE["bf16"] and where in ("dk", "dv")
    assert F.version_error("flash_bwd_bf16", lambda *a: backward(*a, skip=True), SHAPE, xp=np)[0] == math.inf
    err, where = F.version_error("flash_bwd_bf16", lambda *a: 1 / 0, SHAPE, xp=np)
    assert err == math.inf and where.startswith("ZeroDivisionError")


def live_result(rows):
    return {"card": "a GPU", "date": "today", "live": True, "rows": [
        {"op": op, "shape": "B1 nh2 T70 hs16", "backend": backend, "version": v, "ms": 0.1} for op, backend, v in rows]}


def test_a_live_table_shows_wrong_versions_without_a_time(monkeypatch):
    calls = {("flash_bwd_bf16", "v2"): backward, ("flash_bwd_bf16", "v3"): lambda *a: backward(*a, swap=True),
             ("flash_bwd_bf16", "v5-fused"): lambda *a: backward(*a, skip=True),
             ("flash_fwd_bf16", "v2"): forward}
    monkeypatch.setattr(F, "_launch", lambda backend, op, version: calls[op, version])
    result = F.checked(live_result([("flash_fwd_bf16", "hip", "v2"), ("flash_bwd_bf16", "hip", "v2"),
                                    ("flash_bwd_bf16", "hip", "v3"), ("flash_bwd_bf16", "hip", "v5-fused"),
                                    ("flash_bwd_bf16", "torch", "2.x")]), xp=np)
    rows = {(r["op"], r["version"]): r for r in result["rows"]}
    assert "ms" in rows["flash_fwd_bf16", "v2"] and "ms" in rows["flash_bwd_bf16", "v2"]
    assert "ms" in rows["flash_bwd_bf16", "2.x"]  # PyTorch's row is the comparison, not a course version
    assert "ms" not in rows["flash_bwd_bf16", "v3"] and rows["flash_bwd_bf16", "v3"]["error"].startswith("wrong (max err")
    assert "ms" not in rows["flash_bwd_bf16", "v5-fused"] and "NaN" in rows["flash_bwd_bf16", "v5-fused"]["error"]
    assert bench.kernel_row(result, "flash_bwd_bf16", "hip", "v3") is None
    text = F.format_checks(result)
    assert "correct (max err" in text and "v3" in text and "wrong (max err" in text


def test_rows_the_benchmark_validated_are_not_run_again(monkeypatch):
    monkeypatch.setattr(F, "_launch", lambda *a: pytest.fail("a validated row was run again"))
    result = live_result([("flash_fwd_bf16", "hip", "v4"), ("flash_bwd_bf16", "hip", "v4")])
    result["rows"][0]["validation"] = {"ok": True, "max_err": 3e-3, "tol": 2e-2}
    result["rows"][1] = {k: result["rows"][1][k] for k in ("op", "shape", "backend", "version")}
    result["rows"][1]["error"] = "wrong (max err 0.5 > tol 0.02 at dq[0, 1, 5, 3])"
    checked = F.checked(result, xp=np)
    assert checked["rows"] == result["rows"]
    assert [c[2][:7] for c in checked["checks"]] == ["correct", "wrong ("]


def test_the_stored_v2_v3_backward_rows_of_2026_12_04_are_not_shown_as_times():
    for name in ("flash_v6_h200", "ncu_flash_h200"):
        run = stored.require(name)
        result = F.checked(dict(run, live=False) if name.startswith("flash") else run)
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


@pytest.mark.parametrize("name", ["flash_h200", "flash_bf16_h200", "flash_v5_h200"])
def test_the_older_stored_runs_keep_every_row(name):
    run = stored.require(name)
    result = F.checked(dict(run, live=False))
    assert result["rows"] == run["rows"] and result["checks"] == []
    assert "on a GPU this cell first checks each version" in F.format_checks(result)
