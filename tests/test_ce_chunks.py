"""The loss head in chunks of rows (engine.build(..., ce_chunks=N), train --ce-chunks, reference/head.py).

Chunked equals unchunked: the NumPy engine to 1e-6 of each tensor's largest value in fp32, the Numba engine in the
CUDA simulator within its usual tolerance of the reference (test_engine.py), for N dividing the rows, not dividing
them, and N = rows; only one chunk's logits exist at a time; two plausible wrong versions (each chunk's own mean,
dwte overwritten by each chunk instead of summed over them) are caught by the same comparisons. engine_memory's
head shrinks as predicted from the shapes; on a GPU (`make gpu-test`) both kernel backends against the unchunked
path, and the prediction within 10% of the pool's measured peak.
"""

import math

import numpy as np
import pytest

from gpullm_lessons import engine, train
from gpullm_lessons.model.params import PRESETS, GPTConfig
from gpullm_lessons.reference import head as ref_head
from gpullm_lessons.reference.crossentropy import crossentropy_backward
from gpullm_lessons.reference.head import chunk_bounds
from test_engine import SMALL, TOY, batch, grads_of, host, max_rel

CPU = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)


def numpy_run(cfg, x, y, ce_chunks):
    eng = engine.build(cfg, "numpy", ce_chunks=ce_chunks)
    loss, g = grads_of(eng, x, y)
    return loss, g, eng.eval_loss(x, y)


@pytest.fixture(scope="module")
def cpu_batch():
    return batch(CPU, 3, 10, seed=1)  # 30 rows


@pytest.fixture(scope="module")
def cpu_unchunked(cpu_batch):
    return numpy_run(CPU, *cpu_batch, 1)


# ---- the chunks ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, chunks", [(30, 1), (30, 5), (30, 4), (30, 7), (30, 30), (10, 6), (1, 1)])
def test_chunk_bounds_cover_the_rows_in_ceil_sized_chunks(rows, chunks):
    b = chunk_bounds(rows, chunks)
    size = math.ceil(rows / chunks)
    assert b[0][0] == 0 and b[-1][1] == rows
    assert all(hi == lo2 for (_, hi), (lo2, _) in zip(b, b[1:]))  # contiguous, in order
    assert all(hi - lo == size for lo, hi in b[:-1]) and 1 <= b[-1][1] - b[-1][0] <= size  # the last one smaller
    assert len(b) <= chunks


@pytest.mark.parametrize("chunks", [0, -2, 2.5, True, "4"])
def test_bad_chunk_counts_are_named(chunks):
    with pytest.raises(ValueError, match="ce_chunks must be a positive integer"):
        chunk_bounds(30, chunks)
    with pytest.raises(engine.EngineError, match="ce_chunks must be a positive integer"):
        engine.build(TOY, "numpy", ce_chunks=chunks)


def test_more_chunks_than_rows_is_named():
    with pytest.raises(ValueError, match="ce_chunks=31 is more than the 30 rows"):
        chunk_bounds(30, 31)
    eng = engine.build(TOY, "numpy", ce_chunks=17)
    x, y = batch(TOY, 2, 8)  # 16 rows
    with pytest.raises(ValueError, match="ce_chunks=17 is more than the 16 rows"):
        eng.forward(x, y)
    with pytest.raises(ValueError, match="ce_chunks=17 is more than the 16 rows"):
        engine.engine_memory(TOY, 2, 8, ce_chunks=17)


# ---- the NumPy engine: chunked == unchunked in fp32 -----------------------------------------------------------------
@pytest.mark.parametrize("ce_chunks", [5, 4, 7, 30])  # dividing the 30 rows, not dividing (8 8 8 6; 5 x 6), N = rows
def test_numpy_chunked_equals_unchunked(cpu_batch, cpu_unchunked, ce_chunks, monkeypatch):
    loss_1, g_1, eval_1 = cpu_unchunked
    shapes = []
    real_linear_forward = ref_head.linear_forward

    def recording(inp, weight, bias=None):  # the head's logits, chunk by chunk
        out, cache = real_linear_forward(inp, weight, bias)
        shapes.append(out.shape)
        return out, cache

    monkeypatch.setattr(ref_head, "linear_forward", recording)
    eng = engine.build(CPU, "numpy", ce_chunks=ce_chunks)
    logits, loss = eng.forward(*cpu_batch)
    eng.backward()
    g = {k: eng.grads[k].copy() for k in eng.grads.names}
    assert logits is None  # never whole
    assert max(s[0] for s in shapes) == math.ceil(30 / ce_chunks) and sum(s[0] for s in shapes) == 30
    assert abs(loss - loss_1) <= 1e-6 * loss_1
    assert max_rel(g, g_1) <= 1e-6
    assert abs(eng.eval_loss(*cpu_batch) - eval_1) <= 1e-6 * eval_1


def test_numpy_chunked_training_follows_the_unchunked_run():
    """Three AdamW steps, the second and third with 2 micro-batches (the loss scale 1/K on the chunked head)."""
    x, y = batch(CPU, 4, 16, seed=2)
    a, b = engine.build(CPU, "numpy"), engine.build(CPU, "numpy", ce_chunks=6)
    for k in (1, 2, 2):
        la = a.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0, micro_batches=k)
        lb = b.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0, micro_batches=k)
        assert abs(la["loss"] - lb["loss"]) <= 1e-6 * la["loss"]
        assert abs(la["grad_norm"] - lb["grad_norm"]) <= 1e-5 * la["grad_norm"]
    assert np.linalg.norm(a.params.flat - b.params.flat) <= 1e-5 * np.linalg.norm(a.params.flat)


def test_numpy_comparison_catches_each_chunks_own_mean(cpu_batch, cpu_unchunked, monkeypatch):
    """A plausible wrong head: each chunk's dlogits divided by its own rows (the chunk's mean, what the loss kernels
    do with the rows they see) instead of the batch's B*T. The comparison above fails on it."""
    monkeypatch.setattr(ref_head, "crossentropy_backward", lambda dloss, cache: crossentropy_backward(1.0, cache))
    _, g, _ = numpy_run(CPU, *cpu_batch, 5)
    assert max_rel(g, cpu_unchunked[1]) > 0.5


# ---- the Numba engine in the CUDA simulator --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_reference():
    x, y = batch(TOY, 2, 8)  # 16 rows
    loss, g = grads_of(engine.build(TOY, "numpy"), x, y)
    return x, y, loss, g


def agrees(loss, g, loss_ref, g_ref):
    """The Numba engine's usual tolerance against the reference (test_engine.test_numba_gradients_match_the_reference)."""
    return abs(loss - loss_ref) <= 1e-5 * loss_ref and max_rel(g, g_ref) < 1e-4


@pytest.mark.parametrize("ce_chunks", [4, 3, 16])  # dividing the 16 rows, not dividing (6 6 4), N = rows
def test_numba_chunked_matches_the_reference(toy_reference, ce_chunks):
    x, y, loss_ref, g_ref = toy_reference
    eng = engine.build(TOY, "numba", ce_chunks=ce_chunks)
    rows, real_gemm = [], eng._gemm

    def recording(a, b, out, *args, **kw):  # the head's logits: lnf (rows, C) @ wte.T -> (rows, V)
        if b is eng._w("wte") and out.shape[-1] == TOY.vocab_size:
            rows.append(out.shape[0])
        return real_gemm(a, b, out, *args, **kw)

    eng._gemm = recording
    logits, loss = eng.forward(x, y)
    eng.backward()
    g = {k: host(eng.grads[k]).copy() for k in eng.grads.names}
    assert logits is None and max(rows) == math.ceil(16 / ce_chunks) and sum(rows) == 16
    assert agrees(loss, g, loss_ref, g_ref), (loss, loss_ref, max_rel(g, g_ref))
    if ce_chunks == 3:  # the forward-only path: the loss kernel alone per chunk
        assert abs(eng.eval_loss(x, y) - loss_ref) <= 1e-5 * loss_ref


def test_numba_chunked_micro_batches_match_the_reference(toy_reference):
    """forward_backward over 2 micro-batches: backward's loss scale 1/2 reaches the head's gradients, which forward
    computed for 1 (GPUEngine.backward scales dlnf and dwte by the rest)."""
    x, y, _, _ = toy_reference
    ref = engine.build(TOY, "numpy")
    loss_ref = ref.forward_backward(x, y, micro_batches=2)
    g_ref = {k: ref.grads[k].copy() for k in ref.grads.names}
    eng = engine.build(TOY, "numba", ce_chunks=3)
    loss = eng.forward_backward(x, y, micro_batches=2)
    g = {k: host(eng.grads[k]).copy() for k in eng.grads.names}
    assert agrees(loss, g, loss_ref, g_ref), (loss, loss_ref, max_rel(g, g_ref))


@pytest.mark.parametrize("mistake", ["each chunk's own mean", "dwte overwritten"])
def test_numba_comparison_catches_a_wrong_chunked_head(toy_reference, mistake):
    """The same engine with the head's products done wrong: alpha left at 1 (each chunk's dlogits keep the loss
    kernel's 1/rows of the chunk: its own mean, not the batch's), or beta left at 0 (each chunk's dlogits.T @ lnf
    overwrites dwte instead of adding to it: only the last chunk's share survives). agrees() fails on both."""
    x, y, loss_ref, g_ref = toy_reference
    eng = engine.build(TOY, "numba", ce_chunks=4)
    real_gemm = eng._gemm

    def wrong(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        if mistake == "each chunk's own mean":
            alpha = 1.0  # (every other product of this fp32 step has alpha 1 anyway)
        else:
            beta = 0.0
        return real_gemm(a, b, out, trans_a, trans_b, alpha, beta)

    eng._gemm = wrong
    loss, g = grads_of(eng, x, y)
    assert not agrees(loss, g, loss_ref, g_ref)
    assert max_rel(g, g_ref) > 0.1


# ---- engine_memory -------------------------------------------------------------------------------------------------
def test_engine_memory_head_shrinks_with_the_chunks():
    """GPT-2 at B16 T1024, bf16: without chunks the head holds the fp32 logits and bf16 dlogits (B*T, V) plus lnf's
    bf16 output; with N chunks one chunk's logits and dlogits, and dlnf fp32 (B*T, C), which the forward keeps for
    backward instead of dlogits and lnf's output."""
    cfg = GPTConfig(**{k: v for k, v in PRESETS["gpt2"].items() if k not in ("batch_size", "lr")})
    B, T, V, C = 16, 1024, cfg.vocab_size, cfg.d_model
    N = B * T
    m = {n: engine.engine_memory(cfg, B, T, "bf16", "none", ce_chunks=n) for n in (1, 4, 16)}
    for n in (4, 16):
        rows = math.ceil(N / n)
        assert m[1]["head"] - m[n]["head"] == (N - rows) * V * (4 + 2) - N * C * 4
        assert m[1]["activations"] - m[n]["activations"] == N * V * 2 + N * C * 2 - N * C * 4
        for key in ("params", "params_half", "grads", "adamw", "activations_per_block"):
            assert m[n][key] == m[1][key]
    assert m[1]["total"] > m[4]["total"] > m[16]["total"]
    assert m[1]["total"] - m[16]["total"] > 2**30 * 3  # GiBs, not MiBs: 17.5 -> 13.8 GiB
    # fp16 chunks hold the fp32 dlogits, their scaled fp32 copy and the fp16 copy: 4 + 4 + 2 bytes, + the logits
    h16 = {n: engine.engine_memory(cfg, 3, 7, "fp16", ce_chunks=n)["head"] for n in (4, 5)}  # 21 rows: 6, 5 a chunk
    assert h16[4] - h16[5] == (6 - 5) * V * (4 + 4 + 4 + 2)


# ---- train.py ---------------------------------------------------------------------------------------------------------
def test_train_refuses_more_chunks_than_rows_and_records_the_setting(tmp_path):
    args = ["--preset", "tiny", "--backend", "numpy", "--batch-size", "2", "--seq-len", "8", "--steps", "2"]
    with pytest.raises(train.ConfigError, match="--ce-chunks 17 is more than the 16 rows"):
        train.main(args + ["--ce-chunks", "17", "--out", str(tmp_path / "a")])
    with pytest.raises(train.ConfigError, match="--ce-chunks must be a positive integer, got 0"):
        train.main(args + ["--ce-chunks", "0", "--out", str(tmp_path / "a")])
    assert "ce_chunks" not in train.RESUME_MUST_MATCH  # rounding only: a resumed run may change it (a note)


# ---- on a GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hip", "numba"])
@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), ("bf16", 3e-2), ("fp16", 5e-3)])
def test_gpu_chunked_head_matches_the_unchunked_one(backend, precision, tol):
    """SMALL at B8 T64 (512 rows) in 3 chunks (171 171 170): the gradients against the same engine without chunks,
    within fp32 rounding in fp32 and within the format's rounding in half precision (the chunk's dlogits are
    rounded from (probs - onehot) / rows of the chunk, not / B*T); then 10 steps (on hip fp32 / bf16 replayed as a
    CUDA graph) track the unchunked run."""
    x, y = batch(SMALL, 8, 64)
    loss_1, g_1 = grads_of(engine.build(SMALL, backend, precision=precision), x, y)
    loss_n, g_n = grads_of(engine.build(SMALL, backend, precision=precision, ce_chunks=3), x, y)
    assert abs(loss_n - loss_1) <= 1e-5 * loss_1
    assert max_rel(g_n, g_1) < tol
    batches = [batch(SMALL, 8, 64, seed=s) for s in range(10)]
    a, b = (
        engine.build(SMALL, backend, precision=precision),
        engine.build(SMALL, backend, precision=precision, ce_chunks=3),
    )
    la = [a.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in batches]
    lb = [b.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=1.0)["loss"] for x, y in batches]
    assert a.graphs == b.graphs
    assert np.max(np.abs(np.array(lb) - la) / np.array(la)) < (1e-4 if precision == "fp32" else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("ce_chunks", [1, 8])
def test_gpu_engine_memory_with_chunks_within_10_percent_of_the_pool_peak(precision, ce_chunks):
    """A vocabulary large enough for the head to be the largest phase without chunks (32768 x 8192 rows)."""
    from gpullm_lessons.bench.train_step import measure_engine

    cfg = GPTConfig(vocab_size=32768, block_size=256, n_layer=4, n_head=6, d_model=384)
    r = measure_engine(cfg, 32, 256, precision, "none", steps=2, ce_chunks=ce_chunks)
    predicted = engine.engine_memory(cfg, 32, 256, precision, "none", ce_chunks=ce_chunks)["total"]
    assert abs(predicted - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (predicted, r["peak_bytes"])
