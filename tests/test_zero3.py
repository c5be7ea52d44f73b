"""ZeRO-3 in one process (parallel/zero3.py): a world of one rank (SingleComm) is NumpyEngine's training step, the
memory model equals the bytes the step measures, and bad input is named. 2 and 4 MPI ranks: tests/test_zero3_ranks.py."""

import numpy as np
import pytest

from gpullm_lessons import engine
from gpullm_lessons.model.params import GPTConfig, init_params, num_params
from gpullm_lessons.parallel import zero3 as Z
from gpullm_lessons.parallel.comm import SingleComm

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32)


def batches(n, B=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 64, (B, 16)), rng.integers(0, 64, (B, 16))) for _ in range(n)]


def test_one_rank_is_the_numpy_engine_bitwise():
    # the same ops in the same order, an elementwise AdamW: only the float64 norm's summation order differs, which
    # leaves the float32 clip factor unchanged here (clipping is active: the norm is above 1)
    eng = engine.build(CFG, "numpy", seed=0)
    z = Z.Zero3(CFG, SingleComm(), init_params(CFG, seed=0))
    for x, y in batches(3):
        a = eng.train_step(x, y, 1e-3, 0.1, 1.0)
        b = z.train_step(x, y, 1e-3, 0.1, 1.0)
        assert a["loss"] == b["loss"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12) and a["grad_norm"] > 1.0
    assert np.array_equal(z.full_params(), eng.params.flat)
    assert z.t == eng.t == 3


def test_the_shards_cover_each_unit_once_with_zero_padding():
    units = Z.zero3_units(CFG)
    assert len(units) == CFG.n_layer + 2
    assert [n for n, _ in Z.unit_sizes(CFG, 1)] == [sum(hi - lo for _, lo, hi, _ in u) for u in units]
    assert sum(n for n, _ in Z.unit_sizes(CFG, 4)) == num_params(CFG)
    init = init_params(CFG, seed=0).flat
    assert np.array_equal(Z.Zero3(CFG, SingleComm(), init, align=8).full_params(), init)
    n, S = Z.unit_sizes(CFG, 3, align=8)[0]
    assert S % 8 == 0 and 3 * S >= n > 2 * S


def test_measured_peak_equals_the_memory_model():
    z = Z.Zero3(CFG, SingleComm(), init_params(CFG, seed=0))
    model = Z.zero3_memory(CFG, 1)
    for x, y in batches(2):
        res = z.train_step(x, y, 1e-3, 0.1, 1.0)
        assert res["peak_bytes"] == model["peak"]
    assert z.mem.current == model["params"] + model["grads"] + model["optimizer"]  # every gathered buffer freed
    assert res["all_gather"] == Z.zero3_traffic(CFG, 1)["all_gather"]
    assert res["reduce_scatter"] == Z.zero3_traffic(CFG, 1)["reduce_scatter"]


def test_the_measurement_sees_parameters_a_cache_keeps(monkeypatch):
    # without dropping the weights from the blocks' caches, every block's gathered parameters outlive its forward
    monkeypatch.setattr(Z, "_WEIGHT_OF", {})
    z = Z.Zero3(CFG, SingleComm(), init_params(CFG, seed=0))
    ((x, y),) = batches(1)
    assert z.train_step(x, y, 1e-3)["peak_bytes"] > Z.zero3_memory(CFG, 1)["peak"]


def test_memory_model_shards_and_traffic():
    psi = num_params(CFG)
    for W in (1, 2, 4, 8):
        m, t = Z.zero3_memory(CFG, W, align=1), Z.zero3_traffic(CFG, W, align=1)
        sizes = Z.unit_sizes(CFG, W, align=1)
        S = sum(s for _, s in sizes)
        assert m["params"] == m["grads"] == 4 * S and m["optimizer"] == 8 * S and psi / W <= S < psi / W + len(sizes)
        emb, blk, fin = (W * s for _, s in (sizes[0], sizes[1], sizes[-1]))
        assert m["gathered_peak"] == 4 * max(2 * emb + fin, emb + 2 * blk)
        assert m["peak"] == 16 * S + m["gathered_peak"] and m["dp"] == 16 * psi
        assert t["reduce_scatter"] == W * S and abs(t["all_gather"] - (2 * psi - 2 * CFG.d_model)) < 2 * W * len(sizes)
        assert 2.9 < t["total"] / psi < 3.1 and t["dp_all_reduce"] >= 2 * psi
    assert Z.zero3_memory(CFG, 4)["peak"] < Z.zero3_memory(CFG, 1)["peak"]


def test_bad_input_is_named():
    init = init_params(CFG, seed=0)
    with pytest.raises(TypeError, match="cfg must be a GPTConfig"):
        Z.Zero3({"n_layer": 4}, SingleComm(), init)
    with pytest.raises(ValueError, match="params hold"):
        Z.Zero3(CFG, SingleComm(), init.flat[:-1])
    with pytest.raises(ValueError, match="align must be a positive integer"):
        Z.Zero3(CFG, SingleComm(), init, align=0)
    with pytest.raises(ValueError, match="world must be a positive integer"):
        Z.zero3_memory(CFG, 0)
    z = Z.Zero3(CFG, SingleComm(), init)
    x = np.zeros((2, 16), np.int64)
    with pytest.raises(ValueError, match="x and y must be"):
        z.train_step(x, x[:1], 1e-3)
    with pytest.raises(ValueError, match="longer than block_size"):
        z.train_step(np.zeros((2, 17), int), np.zeros((2, 17), int), 1e-3)
    with pytest.raises(ValueError, match=r"token ids in \[0, 64\)"):
        z.train_step(x + 64, x, 1e-3)
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        z.W = 3
        z.rows(8)
