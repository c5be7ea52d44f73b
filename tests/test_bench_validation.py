"""Validate, then time (llm.c's dev/cuda benchmarks): every row of `bench kernels` and of `bench train` is checked
against the reference before it is timed, and a wrong version gets no time.

The GPU paths cannot run here, so the core runs on NumPy arrays: the benchmark's own cases (bench._cases with
NumPy inputs at the --small shapes), their references and outputs, and stand-ins for the kernels (right ones, one
element off past the first tile, an element never written, an exception), with a stand-in timer. The stored results
were timed before validation existed: a strict xfail lists them until they are re-measured on a GPU."""

import numpy as np
import pytest

from gpullm_lessons.bench import kernels as bench, stored, timing
from gpullm_lessons.bench import train_step as bt
from gpullm_lessons import engine
from gpullm_lessons.model.optim import adamw_update
from gpullm_lessons.model.params import GPTConfig


@pytest.fixture(scope="module")
def cases():
    return {c.op: c for c in bench._cases(True, np)}


class Timer:
    """A stand-in for the CUDA-graph timer: counts the calls it is asked to time."""

    def __init__(self):
        self.timed = []

    def __call__(self, run, backend):
        self.timed.append(backend)
        return {"ms": 1.0, "timing": "graph"}


def writes(case, args, expected, change=None):
    """A stand-in kernel: writes the reference's values (float32) into the case's outputs, then change(outputs)."""

    def run():
        outs = {name: args[i] for name, i in case.outputs.items()}
        for name, a in outs.items():
            a[...] = expected[name]
        if change is not None:
            change(outs)

    return run


def test_a_right_version_is_timed_and_a_wrong_one_is_a_wrong_row_without_a_time(cases):
    case = cases["softmax"]
    args = list(case.make(np.random.default_rng(0)))
    expected = case.reference(args)
    i, j = 70, 40                                                    # past the first 32 x 32 tile
    scale = float(np.abs(expected["dinp"]).max())

    def one_off(outs):
        outs["dinp"][i, j] += 1e-3 * scale

    timer = Timer()
    rows = bench.case_rows(case, args, [("hip", "v1", writes(case, args, expected)),
                                        ("hip", "v2", writes(case, args, expected, one_off))], timer)
    right, wrong = rows
    assert right["status"] == "ok" and right["ms"] == 1.0
    assert right["validation"]["ok"] is True and right["validation"]["max_err"] < 1e-6
    assert right["validation"]["tol"] == case.tol == 2e-5
    assert wrong["status"] == "wrong" and "ms" not in wrong and "error" in wrong
    v = wrong["validation"]
    assert v["ok"] is False and v["where"] == f"dinp[{i}, {j}]" and v["nonfinite"] == 0
    assert v["max_err"] == pytest.approx(1e-3, rel=1e-3)
    assert timer.timed == ["hip"]                                    # the wrong version was never timed
    assert wrong["error"] == f"wrong (max err 0.001 > tol 2e-05 at dinp[{i}, {j}])"


def test_an_element_never_written_stays_nan_and_makes_the_row_wrong(cases):
    """Outputs are poisoned with NaN before the check: a kernel whose grid misses one element is caught, even though
    the outputs still hold the right values from the version before."""
    case = cases["layernorm"]
    args = list(case.make(np.random.default_rng(1)))
    expected = case.reference(args)

    def misses_one():                                                # dbias[0] is never written
        for name, i in case.outputs.items():
            start = 1 if name == "dbias" else 0
            args[i].reshape(-1)[start:] = expected[name].reshape(-1)[start:]

    timer = Timer()
    rows = bench.case_rows(case, args, [("numba", "v1", writes(case, args, expected)), ("numba", "v2", misses_one)],
                           timer)
    assert [r["status"] for r in rows] == ["ok", "wrong"]
    v = rows[1]["validation"]
    assert v["nonfinite"] == 1 and v["where"] == "dbias[0]" and not v["ok"]
    assert rows[1]["error"].startswith("wrong (1 NaN/inf elements, first at dbias[0]")
    assert timer.timed == ["numba"]


def test_a_version_that_raises_is_wrong_and_the_table_goes_on(cases):
    case = cases["gelu"]
    args = list(case.make(np.random.default_rng(2)))
    expected = case.reference(args)

    def raises():
        raise RuntimeError("launch failed: too many resources requested")

    recovered, timer = [], Timer()
    rows = bench.case_rows(case, args, [("hip", "v1", raises), ("hip", "v2", writes(case, args, expected))], timer,
                           recover=lambda: recovered.append(1))
    assert rows[0]["status"] == "wrong" and rows[0]["validation"]["max_err"] is None
    assert "RuntimeError: launch failed" in rows[0]["validation"]["raised"] and "ms" not in rows[0]
    assert rows[1]["status"] == "ok" and recovered == [1] and timer.timed == ["hip"]


def test_pytorch_rows_are_checked_through_what_they_return(cases):
    case = cases["linear"]
    args = list(case.make(np.random.default_rng(3)))
    e = case.reference(args)
    right = (e["dinp"].astype(np.float32), e["dweight"].astype(np.float32), e["dbias"].astype(np.float32))
    bad_bias = (right[0], right[1], right[2] * 1.01)
    rows = bench.case_rows(case, args, [("torch", "2.x", lambda: right), ("torch", "2.x", lambda: bad_bias),
                                        ("torch", "2.x", lambda: right[:2])], Timer())
    assert [r["status"] for r in rows] == ["ok", "wrong", "wrong"]
    assert rows[1]["validation"]["where"].startswith("dbias[") and rows[1]["validation"]["max_err"] > 1e-3
    assert "returned 2 values" in rows[2]["validation"]["raised"]


def test_adamw_is_checked_from_restored_inputs_and_pytorch_says_why_not(cases):
    """adamw_step overwrites its inputs (p, m, v; g zeroed): each version is checked from the same restored inputs,
    so the second right version is right too; one that forgets to zero the gradient is wrong at grads."""
    case = cases["adamw"]
    args = list(case.make(np.random.default_rng(4)))

    def adamw(zero_grads=True):
        def run():
            p, g, m, v, lr, b1, b2, eps, wd, step = args
            adamw_update(p, g, m, v, step, lr, (b1, b2), eps, wd)
            if zero_grads:
                g[...] = 0
        return run

    timer = Timer()
    rows = bench.case_rows(case, args, [("hip", "v1", adamw()), ("hip", "v2", adamw()),
                                        ("hip", "v3", adamw(zero_grads=False)), ("torch", "2.x", lambda: None)],
                           timer)
    assert [r["status"] for r in rows] == ["ok", "ok", "wrong", "unvalidated"]
    assert rows[2]["validation"]["where"].startswith("grads[")
    assert rows[3]["validation"] == {"ok": None, "why_not": case.torch_why_not} and rows[3]["ms"] == 1.0
    assert timer.timed == ["hip", "hip", "torch"]


def test_every_case_names_outputs_its_reference_computes(cases):
    """For every case of the benchmark: the reference gives each output the launcher writes, with its size, and
    what PyTorch's row returns is among them (or the case says why PyTorch's row is not validated)."""
    rng = np.random.default_rng(5)
    for case in cases.values():
        args = list(case.make(rng))
        expected = case.reference(args)
        assert set(expected) == set(case.outputs), case.op
        for name, i in case.outputs.items():
            assert expected[name].size == args[i].size and expected[name].dtype == np.float64, (case.op, name)
            assert np.isfinite(expected[name]).all(), (case.op, name)
        if case.torch is not None:
            assert set(case.torch_outputs) <= set(expected) and (case.torch_outputs or case.torch_why_not), case.op
        assert 0 < case.tol <= 2e-2, case.op


def test_validate_then_time_on_its_own():
    want = {"out": np.arange(1.0, 5.0)}
    good = lambda: np.arange(1.0, 5.0).astype(np.float32)           # noqa: E731
    r = timing.validate_then_time(good, lambda out: {"out": out}, want, 1e-5, lambda run: {"ms": 2.0})
    assert r == {"status": "ok", "validation": {"max_err": 0.0, "tol": 1e-5, "ok": True, "where": "out[0]",
                                                "nonfinite": 0}, "ms": 2.0}
    nan = lambda: np.array([1.0, np.nan, 3.0, np.inf])               # noqa: E731
    r = timing.validate_then_time(nan, lambda out: {"out": out}, want, 1e-5, pytest.fail)
    assert r["status"] == "wrong" and r["validation"]["nonfinite"] == 2 and r["validation"]["where"] == "out[1]"

    def broken_timer(run):
        raise RuntimeError("capture failed")

    r = timing.validate_then_time(good, lambda out: {"out": out}, want, 1e-5, broken_timer)
    assert r["status"] == "error" and r["validation"]["ok"] and "capture failed" in r["error"]
    r = timing.validate_then_time(good, None, None, 1e-5, lambda run: {"ms": 3.0}, why_not="no reference here")
    assert r == {"status": "unvalidated", "validation": {"ok": None, "why_not": "no reference here"}, "ms": 3.0}


def test_the_kernel_table_says_wrong_with_the_error_and_the_tolerance():
    result = bench.stored_kernels()
    timed = dict(next(r for r in result["rows"] if r["op"] == "softmax" and r["backend"] == "hip"),
                 status="ok", validation={"max_err": 3e-8, "tol": 2e-5, "ok": True, "where": "dinp[0, 1]",
                                          "nonfinite": 0})
    v = {"max_err": 0.31, "tol": 2e-5, "ok": False, "where": "dinp[70, 40]", "nonfinite": 0}
    wrong = {"op": "softmax", "shape": timed["shape"], "backend": "hip", "version": "v9", "status": "wrong",
             "validation": v, "error": timing.wrong_message(v)}
    table = bench.format_kernels(dict(result, rows=[timed, wrong]))
    line = next(ln for ln in table.splitlines() if "v9" in ln)
    assert "wrong (max err 0.31 > tol 2e-05 at dinp[70, 40])" in line
    assert "*" not in table and all(len(ln) <= 100 for ln in table.splitlines())
    assert bench.kernel_row(dict(result, rows=[timed, wrong]), "softmax", "hip", "v9") is None
    assert "timed before the benchmark validated" not in bench.format_kernels(result)  # the stored run: validated
    rows = [{k: v for k, v in r.items() if k not in ("status", "validation")} for r in result["rows"] if "ms" in r]
    old = bench.format_kernels(dict(result, rows=rows))  # a run stored before rows were validated
    assert f"* {len(rows)} rows timed before the benchmark validated each version" in old


# ---- bench train: the first step against the NumPy engine's -------------------------------------------------------

TOY = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16)


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 64, (2, 8)).astype(np.int32), rng.integers(0, 64, (2, 8)).astype(np.int32))
               for _ in range(4)]
    return batches, bt.first_step_reference(TOY, *batches[0])


def numpy_step(change=None):
    eng = engine.build(TOY, "numpy")

    def step(x, y):
        r = eng.train_step(x, y, lr=1e-4, weight_decay=0.1, grad_clip=1.0)
        return change(r) if change else r

    return step


def test_a_right_step_is_timed_and_a_wrong_one_is_not(toy):
    batches, reference = toy
    timed = []

    def time_steps(step, rest):
        timed.append(len(rest))
        return 0.5

    ok = bt.validated_steps(numpy_step(), batches, reference, bt.TRAIN_TOL["fp32"], time_steps)
    assert ok["status"] == "ok" and ok["sec"] == 0.5 and ok["validation"]["max_err"] == 0.0
    assert timed == [len(batches) - 1]                               # the validated first step is not timed
    off = bt.validated_steps(numpy_step(lambda r: dict(r, loss=r["loss"] * 1.01)), batches, reference,
                             bt.TRAIN_TOL["fp32"], time_steps)
    assert off["status"] == "wrong" and "sec" not in off and timed == [len(batches) - 1]
    assert off["validation"]["where"] == "loss" and off["validation"]["max_err"] == pytest.approx(0.01, rel=1e-6)
    nan = bt.validated_steps(numpy_step(lambda r: dict(r, grad_norm=float("nan"))), batches, reference,
                             bt.TRAIN_TOL["bf16"], time_steps)
    assert nan["status"] == "wrong" and nan["validation"]["where"] == "grad_norm"
    skipped = bt.validated_steps(numpy_step(lambda r: dict(r, grad_norm=float("nan"), skipped=True)), batches,
                                 reference, bt.TRAIN_TOL["fp16"], time_steps)
    assert skipped["status"] == "ok"                                  # fp16's skipped step: the loss alone


def test_the_step_table_says_wrong_and_the_reference_is_the_numpy_engine(toy):
    batches, reference = toy
    first = numpy_step()(*batches[0])
    assert reference == {"loss": first["loss"], "grad_norm": first["grad_norm"]}
    v = {"max_err": 0.05, "tol": 1e-4, "ok": False, "where": "loss", "nonfinite": 0}
    row = {"preset": "course", "B": 64, "T": 256, "precision": "fp32", "who": "ours+graph", "version": "hip",
           "status": "wrong", "validation": v, "error": timing.wrong_message(v)}
    result = {"card": "Some GPU", "date": "2030-01-02", "matmul_rates": {"fp32": {"TFLOP/s": 50.0}}, "rows": [row]}
    assert "ours+graph    wrong (max err 0.05 > tol 0.0001 at loss)" in bt.format_train(result)
    assert bench.unvalidated_rows(result) == []


# ---- stored results -----------------------------------------------------------------------------------------------

def test_unvalidated_rows_finds_rows_without_validation():
    v = {"max_err": 1e-7, "tol": 1e-5, "ok": True, "where": "dinp[0, 0]", "nonfinite": 0}
    rows = [{"op": "softmax", "shape": "8x8", "backend": "hip", "version": "v1", "ms": 1.0, "validation": v},
            {"op": "softmax", "shape": "8x8", "backend": "hip", "version": "v2", "ms": 0.5},
            {"op": "adamw", "shape": "8", "backend": "torch", "version": "2.x", "ms": 1.0,
             "validation": {"ok": None, "why_not": "another update"}},
            {"op": "gelu", "shape": "8", "backend": "numba", "version": "v1", "validation": {"ok": None}},
            {"preset": "course", "precision": "bf16", "who": "ours", "step_ms": 3.0},
            {"op": "linear", "backend": "hip", "version": "v1", "duration_us": 3.0},    # ncu: not a timed row
            {"preset": "course", "policy": "full", "precision": "fp32", "step_ms": 2.0}]   # checkpointing
    assert bench.unvalidated_rows({"rows": rows}) == ["softmax hip v2", "gelu numba v1", "course bf16 ours"]
    assert bench.unvalidated_rows({"rows": rows[:1] + rows[2:3]}) == []
    assert bench.unvalidated_rows({"card": "x", "date": "y"}) == []


def stored_unvalidated() -> dict:
    """{stored result: how many of its kernel or step rows lack a validation}."""
    found = {name: len(bench.unvalidated_rows(stored.load(name))) for name in stored.names()}
    return {name: n for name, n in found.items() if n}


def test_the_check_sees_the_stored_kernel_and_step_rows():
    found = stored_unvalidated()
    assert "train_scores_h200" in found and "train_h200" in found and "kernels_h100" not in found
    assert not any(name.endswith("h100") for name in found)  # the runs of 2026-12-06: every row validated
    assert not any(name.startswith(("ncu", "gputime", "checkpointing", "ceilings")) for name in found)


@pytest.mark.xfail(strict=True, reason="timed before validate-then-time; re-measure on a GPU")
def test_stored_kernel_and_train_results_were_validated_before_timing():
    found = stored_unvalidated()
    assert not found, "stored results with rows timed without validation (re-measure with `python -m " \
                      "gpullm_lessons.bench kernels|train --json ...`): " + \
                      ", ".join(f"{name} ({n} rows)" for name, n in found.items())


def test_validate_builds_the_flash_cases_at_the_shape_asked_for():
    at = {c.op: c for c in bench._cases(True, np, flash_shape=(1, 2, 1000, 64))}
    assert at["flash_bwd_bf16"].shape == "B1 nh2 T1000 hs64" and at["flash_fwd"].shape == "B1 nh2 T1000 hs64"
    args = at["flash_fwd_bf16"].make(np.random.default_rng(0))
    assert args[0].shape == (1, 2, 1000, 64) and args[4].shape == (1, 2, 1000)
    assert {c.op: c for c in bench._cases(True, np)}["flash_fwd"].shape == "B1 nh12 T256 hs64"   # default unchanged
    with pytest.raises(ValueError, match="no benchmark case 'flash_fw'"):
        bench.validate(["flash_fw"], versions=["v2"])


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("gpullm_lessons").device.has_gpu(), reason="needs a GPU")
def test_validate_runs_each_version_once_and_says_ok_or_wrong():
    rows = bench.validate(["flash_fwd_bf16", "flash_bwd_bf16"], versions=["v2", "v4"], flash_shape=(1, 2, 1000, 64))
    assert [(r["op"], r["version"]) for r in rows] == [(op, v) for op in ("flash_fwd_bf16", "flash_bwd_bf16")
                                                       for v in ("v2", "v4")]
    assert all(r["status"] == "ok" and r["validation"]["max_err"] < r["validation"]["tol"] for r in rows), rows
    assert not any("ms" in r for r in rows)                                              # validated, not timed


def test_the_reference_cache_gives_the_computed_step_back_and_keys_on_batch_and_model(toy, tmp_path, monkeypatch):
    """GPULLM_REFERENCE_CACHE: the first run computes and keeps the NumPy engine's first step, the next reads it
    (not recomputed: the engine is not even built); another batch or another model is another key."""
    batches, want = toy
    monkeypatch.setenv(bt.REFERENCE_CACHE_ENV, str(tmp_path))
    assert bt.first_step_reference(TOY, *batches[0]) == want
    assert len(list(tmp_path.glob("first_step_*.json"))) == 1
    monkeypatch.setattr(engine, "build", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    assert bt.first_step_reference(TOY, *batches[0]) == want
    other = GPTConfig(**{**vars(TOY), "n_layer": TOY.n_layer + 1})
    keys = {bt._reference_key(TOY, *batches[0]), bt._reference_key(TOY, *batches[1]), bt._reference_key(other, *batches[0])}
    assert len(keys) == 3
