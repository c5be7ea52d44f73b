"""Gradient accumulation (Engine.forward_backward, train_step(micro_batches=K), --grad-accum K).

K micro-batches of b rows give the gradient and the loss of one batch of K b rows: in float64 to 1e-12 (the NumPy
engine with float64 buffers), in float32 within its rounding (the NumPy engine, the numba engine in the simulator,
the HIP engine on a GPU), a whole update too; a gradient that forgets the 1/K is shown to fail the same comparison.
The training job: --grad-accum draws K batches per step, names its bad values, refuses --graphs on, and on 2 MPI ranks
(one all-reduce per step, after the last micro-batch) gives the 1-rank losses.
"""

import json
import re

import numpy as np
import pytest

from gpullm_lessons import device, engine, train
from gpullm_lessons.model.params import GPTConfig, ParamBuffer, init_params

from test_engine import batch, host
from test_train_ranks import TINY, job, losses

TOY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)


def grads_and_loss(eng, x, y, K):
    loss = eng.forward_backward(x, y, K)
    return host(eng.grads.flat).astype(np.float64).copy(), loss


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def float64_engine(cfg):
    """The NumPy engine with float64 parameters and gradients (the reference GPT runs in the buffers' dtype)."""
    eng = engine.build(cfg, "numpy")
    eng.params = init_params(cfg, seed=0, dtype=np.float64)
    eng.grads = ParamBuffer(cfg, dtype=np.float64)
    return eng


@pytest.mark.parametrize("K", [2, 3])
def test_micro_batches_equal_one_batch_in_float64(K):
    x, y = batch(TOY, 6, 8)
    eng = float64_engine(TOY)
    g1, l1 = grads_and_loss(eng, x, y, 1)
    gK, lK = grads_and_loss(eng, x, y, K)
    assert rel(gK, g1) < 1e-12 and abs(lK - l1) < 1e-12 * abs(l1)
    # the comparison has power: the sum of the micro-batches' gradients without the 1/K is K times too large
    wrong = sum(grads_and_loss(eng, x[i * 6 // K:(i + 1) * 6 // K], y[i * 6 // K:(i + 1) * 6 // K], 1)[0]
                for i in range(K))
    assert rel(wrong, g1) > 0.5


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_micro_batches_equal_one_batch_in_float32(backend):
    x, y = batch(TOY, 4, 8, seed=1)
    g1, l1 = grads_and_loss(engine.build(TOY, backend), x, y, 1)
    g2, l2 = grads_and_loss(engine.build(TOY, backend), x, y, 2)
    assert rel(g2, g1) < 1e-5 and abs(l2 - l1) < 1e-5 * l1
    # and the whole update: steps with K = 2 equal steps with the whole batch (two in the simulator, where a step of
    # the numba engine takes seconds: the second is the one that sees the state the first left behind)
    a, b = engine.build(TOY, backend), engine.build(TOY, backend)
    for s in range(3 if backend == "numpy" else 2):
        x, y = batch(TOY, 4, 8, seed=10 + s)
        ra = a.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
        rb = b.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0, micro_batches=2)
        assert abs(ra["loss"] - rb["loss"]) < 1e-5 * ra["loss"]
        assert abs(ra["grad_norm"] - rb["grad_norm"]) < 1e-4 * ra["grad_norm"]
    assert rel(host(b.params.flat), host(a.params.flat)) < 1e-4


def test_micro_batches_must_divide_the_batch():
    eng = engine.build(TOY, "numpy")
    x, y = batch(TOY, 6, 8)
    for K in (4, 0, -1, 7):
        with pytest.raises(ValueError, match=f"micro_batches={K} must be a positive divisor of the batch's 6 rows"):
            eng.forward_backward(x, y, K)


needs_gpu = pytest.mark.skipif(not device.has_gpu(), reason=f"needs a GPU (this machine: {device.kind()})")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_micro_batches_equal_one_batch(precision):
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128)
    x, y = batch(cfg, 8, 64, seed=3)
    g1, l1 = grads_and_loss(engine.build(cfg, "hip", precision=precision), x, y, 1)
    g4, l4 = grads_and_loss(engine.build(cfg, "hip", precision=precision), x, y, 4)
    tol = 1e-5 if precision == "fp32" else 3e-2
    assert rel(g4, g1) < tol and abs(l4 - l1) < tol * l1
    with pytest.raises(engine.EngineError, match="micro_batches > 1"):
        engine.build(cfg, "hip", graphs="on").train_step(x, y, lr=1e-3, micro_batches=2)


# ---- the training job ---------------------------------------------------------------------------------------------


def test_the_job_draws_k_batches_per_step(tmp_path):
    """--grad-accum 2 draws two batches of --batch-size per update: after 3 steps the sampler stands where 6 plain
    steps leave it (and not where 3 plain steps do); the run logs every step and records grad_accum in its
    checkpoint."""
    out = tmp_path / "acc"
    flags = [str(a) for a in TINY] + ["--steps", "3", "--batch-size", "4", "--grad-accum", "2", "--out", str(out)]
    train.main(flags + ["--checkpoint-every", "3"])
    recs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in recs)
    ck = train.load_checkpoint(out / "ckpt.npz")
    assert ck["config"]["grad_accum"] == 2
    plain = tmp_path / "plain"
    train.main([str(a) for a in TINY] + ["--steps", "3", "--batch-size", "4", "--out", str(plain),
                                          "--checkpoint-every", "3"])
    # 3 steps x 2 batches of the accumulating run = the sampler's position after 6 plain steps' batches
    six = tmp_path / "six"
    train.main([str(a) for a in TINY] + ["--steps", "6", "--batch-size", "4", "--out", str(six),
                                          "--checkpoint-every", "6"])
    assert ck["progress"]["sampler"] == train.load_checkpoint(six / "ckpt.npz")["progress"]["sampler"]
    assert ck["progress"]["sampler"] != train.load_checkpoint(plain / "ckpt.npz")["progress"]["sampler"]


@pytest.mark.parametrize("flags, message", [
    (["--grad-accum", "0"], "--grad-accum must be a positive integer, got 0"),
    (["--grad-accum", "2", "--graphs", "on"], "--graphs on with --grad-accum 2"),
])
def test_the_job_names_bad_grad_accum(tmp_path, flags, message):
    with pytest.raises(train.ConfigError, match=re.escape(message)):
        train.main([str(a) for a in TINY] + ["--steps", "1", "--out", str(tmp_path)] + flags)


def test_resume_with_another_grad_accum_is_refused(tmp_path):
    out = tmp_path / "run"
    base = [str(a) for a in TINY] + ["--out", str(out), "--checkpoint-every", "1"]
    train.main(base + ["--steps", "1"])
    with pytest.raises(train.ConfigError, match="grad_accum 1 != 2"):
        train.main(base + ["--steps", "2", "--grad-accum", "2", "--resume"])
    train.main(base + ["--steps", "2", "--resume"])  # the same setting resumes


def test_two_ranks_accumulate_like_one(tmp_path):
    """Each rank's rows of each micro-batch, one all-reduce after the last: the 1-rank losses on 2 MPI ranks."""
    args = TINY + ["--steps", "3", "--grad-accum", "2"]
    one, two = tmp_path / "one", tmp_path / "two"
    p1 = job(1, args + ["--out", one])
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = job(2, args + ["--out", two])
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)


def test_a_checkpoint_from_before_the_flag_counts_as_one_micro_batch():
    old = {"model": {"n_layer": 1}, "batch_size": 8}  # no grad_accum: written before the setting existed
    assert train.config_differences(old, {"model": {"n_layer": 1}, "batch_size": 8, "grad_accum": 1},
                                    ["grad_accum"]) == []
    assert train.config_differences(old, {"model": {"n_layer": 1}, "batch_size": 8, "grad_accum": 2},
                                    ["grad_accum"]) == ["grad_accum 1 != 2"]
