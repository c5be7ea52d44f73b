"""Tensor parallelism in one process (parallel/tensor.py): a world of one rank (SingleComm) is NumpyEngine's training
step bitwise, N = 2 and 4 ranks simulated in one process give the one-rank gradients, losses and parameters within
rounding, the memory model equals the bytes the step holds, and bad input is named. 2 and 4 MPI ranks:
tests/test_tensor_parallel_ranks.py."""

import numpy as np
import pytest

from gpullm_lessons import engine
from gpullm_lessons.model.params import GPTConfig, init_params, num_params, param_shapes
from gpullm_lessons.parallel import tensor as TP
from gpullm_lessons.parallel.comm import SingleComm

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, d_model=32)
# N ranks against one: the row-parallel products summed over ranks and the f all-reduce's partial input gradients, a
# different order of the same float32 additions (about 1e-7 relative), carried by AdamW into the next steps
# (parallel/tensor.py, "Numerics"); measured: losses about 0 to 1e-7, parameters about 1e-6 after 3 steps
ATOL = 1e-5


def batches(n, B=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 64, (B, 16)), rng.integers(0, 64, (B, 16))) for _ in range(n)]


def test_one_rank_is_the_numpy_engine_bitwise():
    # the same ops in the same order, an elementwise AdamW: only the float64 norm's summation order differs (tensor
    # by tensor), which leaves the float32 clip factor unchanged here (clipping is active: the norm is above 1)
    eng = engine.build(CFG, "numpy", seed=0)
    tp = TP.TensorParallel(CFG, SingleComm(), init_params(CFG, seed=0))
    for x, y in batches(3):
        a = eng.train_step(x, y, 1e-3, 0.1, 1.0)
        b = tp.train_step(x, y, 1e-3, 0.1, 1.0)
        assert a["loss"] == b["loss"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12) and a["grad_norm"] > 1.0
    assert np.array_equal(tp.full_params(), eng.params.flat)
    assert tp.t == eng.t == 3


@pytest.mark.parametrize("N", [2, 4])
def test_simulated_ranks_give_the_one_rank_gradients_losses_and_parameters(N):
    init = init_params(CFG, seed=0)
    one, ranks = TP.tp_ranks(CFG, 1, init), TP.tp_ranks(CFG, N, init)
    assert np.array_equal(TP.simulated_full_params(ranks), init.flat)  # the shards cover every tensor once
    # the first step's gradients (the f / g all-reduces in forward and backward), before any update
    (x, y), *rest = batches(3)
    sims = [TP.simulate_step(rs, x, y, 1e-3, 0.1, 1.0) for rs in (one, ranks)]
    np.testing.assert_allclose(TP.simulated_full_params(ranks, "g"), TP.simulated_full_params(one, "g"), atol=1e-6)
    for x, y in rest:
        a = TP.simulate_step(one, x, y, 1e-3, 0.1, 1.0)
        b = TP.simulate_step(ranks, x, y, 1e-3, 0.1, 1.0)
        assert b["loss"] == pytest.approx(a["loss"], abs=ATOL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        sims.append(b)
    np.testing.assert_allclose(TP.simulated_full_params(ranks), TP.simulated_full_params(one), rtol=0, atol=ATOL)
    # the replicated parameters: bitwise the same on every rank, with no communication of their gradients
    assert all(np.array_equal(r.replicated(), ranks[0].replicated()) for r in ranks)
    # memory and traffic: measured = modelled
    model = TP.tp_memory(CFG, N)
    assert sims[-1]["bytes"] == [model["total"]] * N
    traffic = TP.tp_traffic(CFG, N, 8, 16)
    assert sims[-1]["all_reduce"] == traffic["all_reduce"] == 4 * CFG.n_layer * 8 * 16 * CFG.d_model
    assert sims[-1]["all_reduces"] == traffic["all_reduces"] == 4 * CFG.n_layer


def test_the_qkv_split_takes_each_rank_heads_from_q_k_and_v():
    C, N = CFG.d_model, 2
    full = np.arange(CFG.n_layer * C * 3 * C, dtype=np.float32).reshape(CFG.n_layer, C, 3 * C)
    cols = full[0, 0]  # column j of the packed q | k | v
    r1 = TP.shard_of(CFG, "qkvw", full, N, 1)[0, 0]
    assert np.array_equal(r1, np.concatenate([cols[16:32], cols[48:64], cols[80:96]]))  # heads 2, 3 of each
    assert TP.tp_shapes(CFG, N)["qkvw"] == (CFG.n_layer, C, 3 * C // N)
    assert TP.tp_shapes(CFG, N)["attprojw"] == (CFG.n_layer, C // N, C)
    assert TP.tp_shapes(CFG, N)["fcprojw"] == (CFG.n_layer, 4 * C // N, C)
    assert TP.tp_shapes(CFG, N)["attprojb"] == param_shapes(CFG)["attprojb"]  # added once, after the all-reduce
    # full_params on one rank gives back the model
    init = init_params(CFG, seed=1)
    assert np.array_equal(TP.TensorParallel(CFG, SingleComm(), init).full_params(), init.flat)


def test_memory_model():
    V, T, L, C = CFG.vocab_size, CFG.block_size, CFG.n_layer, CFG.d_model
    for N in (1, 2, 4):
        m = TP.tp_memory(CFG, N)
        assert m["elements"] == V * C + T * C + 2 * C + L * (6 * C + (12 * C * C + 7 * C) // N)
        assert m["params"] == m["grads"] == 4 * m["elements"] and m["optimizer"] == 8 * m["elements"]
        assert m["total"] == 16 * m["elements"] and m["dp"] == 16 * num_params(CFG)
    assert TP.tp_memory(CFG, 1)["total"] == TP.tp_memory(CFG, 1)["dp"]  # one rank holds the whole model
    assert TP.tp_memory(CFG, 4)["split"] * 4 == TP.tp_memory(CFG, 1)["split"]
    tp = TP.TensorParallel(CFG, SingleComm(), init_params(CFG, seed=0))
    assert tp.memory_bytes() == TP.tp_memory(CFG, 1)["total"]
    t = TP.tp_traffic(CFG, 4, 8, 16)
    assert t["ring_bytes_per_rank"] == 2 * 3 * 4 * t["all_reduce"] // 4  # 2 (N-1)/N x 4 B per element


def test_the_command_on_one_rank(capsys):
    argv = ["--n-layer", "2", "--n-head", "2", "--d-model", "16", "--block-size", "8", "--batch-size", "4"]
    res = TP.main([*argv, "--steps", "2"], comm=SingleComm())
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, d_model=16)
    assert len(res["losses"]) == 2 and res["replicated_equal"] is True
    assert res["bytes"] == [[TP.tp_memory(cfg, 1)["total"]]] * 2
    assert res["traffic_measured"]["all_reduce"] == TP.tp_traffic(cfg, 1, 4, 8)["all_reduce"]
    out = capsys.readouterr().out
    assert "all-reduced" in out and "bytes per rank" in out


def test_bad_input_is_named():
    from gpullm_lessons.train import ConfigError

    with pytest.raises(ValueError, match="n_head 4 does not split over 3 ranks"):
        TP.tp_memory(CFG, 3)
    with pytest.raises(ValueError, match="n_head 4 does not split over 8 ranks"):
        TP.tp_ranks(CFG, 8, init_params(CFG, seed=0))
    with pytest.raises(ValueError, match="world must be a positive integer"):
        TP.tp_shapes(CFG, 0)
    with pytest.raises(TypeError, match="cfg must be a GPTConfig"):
        TP.tp_memory(dict(n_head=4), 2)
    with pytest.raises(ValueError, match="params hold"):
        TP.TensorParallel(CFG, SingleComm(), np.zeros(10, np.float32))
    tp = TP.TensorParallel(CFG, SingleComm(), init_params(CFG, seed=0))
    with pytest.raises(ValueError, match="longer than block_size"):
        tp.train_step(np.zeros((2, 17), int), np.zeros((2, 17), int), 1e-3)
    with pytest.raises(ValueError, match="token ids in"):
        tp.train_step(np.full((2, 4), 64), np.zeros((2, 4), int), 1e-3)
    ranks = TP.tp_ranks(CFG, 2, init_params(CFG, seed=0))
    with pytest.raises(ValueError, match="pass ranks 0 .. N-1"):
        TP.simulate_step(ranks[::-1], *batches(1)[0], 1e-3)
    with pytest.raises(ConfigError, match="--n-head 3 does not split over 2 ranks"):
        TP.main(["--n-head", "3", "--d-model", "24"], comm=TP._Rank(0, 2))


# ---- sequence parallelism on top (SequenceParallel) ----------------------------------------------------------------
def test_sequence_parallel_on_one_rank_is_the_numpy_engine_bitwise():
    eng = engine.build(CFG, "numpy", seed=0)
    sp = TP.SequenceParallel(CFG, SingleComm(), init_params(CFG, seed=0))
    for x, y in batches(3):
        a, b = eng.train_step(x, y, 1e-3, 0.1, 1.0), sp.train_step(x, y, 1e-3, 0.1, 1.0)
        assert a["loss"] == b["loss"] and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12)
    assert np.array_equal(sp.full_params(), eng.params.flat)


@pytest.mark.parametrize("N", [2, 4])
def test_sequence_parallel_ranks_give_the_one_rank_step_and_split_the_layernorm_activations(N):
    init = init_params(CFG, seed=0)
    one, tp, sp = TP.tp_ranks(CFG, 1, init), TP.tp_ranks(CFG, N, init), TP.tp_ranks(CFG, N, init, sequence=True)
    for x, y in batches(3):
        a, t, b = (TP.simulate_step(rs, x, y, 1e-3, 0.1, 1.0) for rs in (one, tp, sp))
        assert b["loss"] == pytest.approx(a["loss"], abs=ATOL) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-5
        )
    np.testing.assert_allclose(TP.simulated_full_params(sp), TP.simulated_full_params(one), rtol=0, atol=ATOL)
    assert all(np.array_equal(r.replicated(), sp[0].replicated()) for r in sp)  # after the partial gradients' sum
    # the saving: the LayerNorms' inputs and statistics and the token ids, (1 - 1/N) of them (the module docstring)
    B, T, C, L = 8, 16, CFG.d_model, CFG.n_layer
    split = 4 * (L * 2 * (B * T * C + 2 * B * T) + B * T)
    assert [t - s for t, s in zip(t["cache_bytes"], b["cache_bytes"])] == [split * (N - 1) // N] * N


def test_sequence_parallel_refuses_a_sequence_the_ranks_cannot_split():
    sp = TP.tp_ranks(CFG, 2, init_params(CFG, seed=0), sequence=True)
    with pytest.raises(ValueError, match="T=15 positions do not split over 2 ranks"):
        TP.simulate_step(sp, np.zeros((2, 15), int), np.zeros((2, 15), int), 1e-3)
