"""DeepSpeed-Ulysses sequence parallelism in one process (parallel/ulysses.py): one rank (SingleComm) is NumpyEngine's
step bitwise, N = 2 and 4 simulated ranks give the one-rank losses, gradients and parameters within rounding, each
rank's activations are exactly 1/N of one rank's, the all-to-all is right on every engine-free path, and bad input is
named. 2 and 4 MPI ranks: tests/test_ulysses_ranks.py."""

import numpy as np
import pytest

from gpullm_lessons import engine
from gpullm_lessons.model.params import GPTConfig, init_params
from gpullm_lessons.parallel import ulysses as U
from gpullm_lessons.parallel.comm import SingleComm

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
# N ranks against one: each weight's gradient summed over positions in N partial sums, the loss a mean of N means:
# about 1e-7 relative in float32, carried by AdamW (the module's "Numerics"); measured about 1e-7 and 1e-6
ATOL = 1e-5


def batches(n, B=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 64, (B, 16)), rng.integers(0, 64, (B, 16))) for _ in range(n)]


def test_one_rank_is_the_numpy_engine_bitwise():
    eng = engine.build(CFG, "numpy", seed=0)
    u = U.Ulysses(CFG, SingleComm(), init_params(CFG, seed=0))
    for x, y in batches(3):
        a, b = eng.train_step(x, y, 1e-3, 0.1, 1.0), u.train_step(x, y, 1e-3, 0.1, 1.0)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["grad_norm"] > 1.0
    assert np.array_equal(u.P.flat, eng.params.flat)


@pytest.mark.parametrize("N", [2, 4])
def test_simulated_ranks_give_the_one_rank_step_and_a_1_over_N_share_of_the_activations(N):
    init = init_params(CFG, seed=0)
    one, ranks = U.ulysses_ranks(CFG, 1, init), U.ulysses_ranks(CFG, N, init)
    (x, y), *rest = batches(3)
    a, b = U.simulate_step(one, x, y, 1e-3, 0.1, 1.0), U.simulate_step(ranks, x, y, 1e-3, 0.1, 1.0)
    # every tensor the forward keeps is per position or per head: each rank holds exactly 1/N of one rank's bytes
    assert b["cache_bytes"] == [a["cache_bytes"][0] // N] * N and a["cache_bytes"][0] % N == 0
    assert b["loss"] == pytest.approx(a["loss"], abs=ATOL)
    for x, y in rest:
        a, b = U.simulate_step(one, x, y, 1e-3, 0.1, 1.0), U.simulate_step(ranks, x, y, 1e-3, 0.1, 1.0)
        assert b["loss"] == pytest.approx(a["loss"], abs=ATOL) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-5
        )
    np.testing.assert_allclose(ranks[0].P.flat, one[0].P.flat, rtol=0, atol=ATOL)
    assert all(np.array_equal(r.P.flat, ranks[0].P.flat) for r in ranks)  # the replicas stay equal


@pytest.mark.parametrize("wrong", ["transposed", "own chunks"])
def test_a_wrong_exchange_is_caught_by_the_one_rank_comparison(wrong):
    """The comparison above can fail: a rank receiving its own outgoing chunks (the exchange transposed) or keeping
    the chunk meant for itself everywhere (attention over its own positions only: local, not causal over the
    sequence) gives another loss."""
    init = init_params(CFG, seed=0)
    ((x, y),) = batches(1)
    a = U.simulate_step(U.ulysses_ranks(CFG, 1, init), x, y, 1e-3)
    exchanges = {
        "right": lambda out: [[out[i][j] for i in range(2)] for j in range(2)],  # rank j gets chunk j of every rank i
        "transposed": lambda out: [[out[j][i] for i in range(2)] for j in range(2)],
        "own chunks": lambda out: [[out[j][j]] * 2 for j in range(2)],
    }
    right = U._forward_backward(U.ulysses_ranks(CFG, 2, init), x, y, exchanges["right"])[0]
    assert abs(sum(right) / 2 - a["loss"]) < ATOL
    bad = U._forward_backward(U.ulysses_ranks(CFG, 2, init), x, y, exchanges[wrong])[0]
    assert abs(sum(bad) / 2 - a["loss"]) > 1e-4


def test_all_to_all_on_one_rank_copies_and_names_bad_buffers():
    c = SingleComm()
    send, recv = np.arange(6, dtype=np.float32), np.zeros(6, np.float32)
    c.all_to_all(send, recv)
    assert np.array_equal(recv, send)
    with pytest.raises(ValueError, match="equal chunks"):
        c.all_to_all(send, np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="must match"):
        c.all_to_all(send, np.zeros(6, np.float64))


def test_traffic_model_and_bad_input():
    t = U.ulysses_traffic(CFG, 2, 4, 16)
    assert t["all_to_all"] == 8 * 2 * 4 * 16 * 32 // 2 and t["sent"] == t["all_to_all"] // 2 and t["all_to_alls"] == 8
    with pytest.raises(ValueError, match="n_head 4 does not split over 3 ranks"):
        U.ulysses_ranks(CFG, 3, init_params(CFG, seed=0))
    with pytest.raises(ValueError, match="T=15 positions do not split over 2 ranks"):
        U.simulate_step(
            U.ulysses_ranks(CFG, 2, init_params(CFG, seed=0)), np.zeros((2, 15), int), np.zeros((2, 15), int), 1e-3
        )
    with pytest.raises(ValueError, match="token ids"):
        U.Ulysses(CFG, SingleComm(), init_params(CFG, seed=0)).train_step(
            np.full((2, 16), 99), np.zeros((2, 16), int), 1e-3
        )
