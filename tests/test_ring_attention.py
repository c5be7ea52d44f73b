"""Ring attention in one process (parallel/ring_attention.py): the merge of partial results against sdpa over all
keys (and planted wrong merges failing the same comparison), N = 1..4 simulated ranks against one-rank sdpa
forward and backward, planted wrong masks, the refusals. Real ranks: tests/test_ring_attention_ranks.py."""

import numpy as np
import pytest

from gpullm_lessons.parallel import ring_attention as RA
from gpullm_lessons.parallel.comm import SingleComm
from gpullm_lessons.reference.attention import attention_mask, sdpa_backward, sdpa_forward

# max|err| / max|reference|: float64 merges to a few ulps (about 1e-16 here), float32 to about 1e-7; each limit
# leaves a factor of 10 or more and is far below what any planted bug gives (1e-2 and up, or NaN)
MERGE_TOL = {np.float64: 1e-12, np.float32: 1e-6}
# the ring: the same merges N times plus sdpa's own rounding, measured about 1e-15 (float64) and 3e-7 (float32)
RING_TOL = {np.float64: 1e-12, np.float32: 1e-5}


def rel_err(a, ref):
    """max|a - ref| / max|ref|, inf when a has a NaN or inf where ref has none."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    bad = ~np.isfinite(a) & np.isfinite(ref)
    if bad.any():
        return np.inf
    both_inf = ~np.isfinite(a) & ~np.isfinite(ref) & (a == ref)  # lse -inf on both sides
    d = np.where(both_inf, 0.0, np.abs(a - ref))
    return float(d.max() / max(np.abs(np.where(np.isfinite(ref), ref, 0)).max(), 1e-300))


def qkv(shape=(2, 3, 12, 8), dtype=np.float64, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    return (q * dtype(scale)).astype(dtype), k, v, dout


def merge_error(merge, q, k, v, causal, split):
    """Attention over keys [0, split) and [split, T) (sdpa with the causal mask's columns), merged by `merge`,
    against sdpa over all keys: (out error, lse error)."""
    T = k.shape[2]
    allowed = attention_mask(T, T, causal=causal)
    halves = []
    for cols in (slice(0, split), slice(split, T)):
        out, cache = sdpa_forward(q, k[:, :, cols], v[:, :, cols], causal=False, mask=allowed[:, cols])
        halves += [out, cache["lse"]]
    ref, cache = sdpa_forward(q, k, v, causal=causal)
    with np.errstate(all="ignore"):  # the planted merges overflow
        out, lse = merge(*halves)
    return rel_err(out, ref), rel_err(lse, cache["lse"])


# ---- the merge -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split", [1, 5, 11])
def test_merging_two_key_halves_is_attention_over_all_keys(dtype, causal, split):
    q, k, v, _ = qkv(dtype=dtype)
    e_out, e_lse = merge_error(RA.merge_partials, q, k, v, causal, split)
    assert e_out < MERGE_TOL[dtype] and e_lse < MERGE_TOL[dtype], (e_out, e_lse)


def test_the_merge_is_stable_for_large_scores():
    """Scores of several thousand: exp(lse) overflows even float64, exp(lse - max) never does."""
    for dtype in (np.float64, np.float32):
        q, k, v, _ = qkv(dtype=dtype, scale=300.0)
        _, cache = sdpa_forward(q, k, v, causal=False)
        assert np.abs(cache["lse"]).max() > 1000
        e_out, e_lse = merge_error(RA.merge_partials, q, k, v, False, 6)
        assert e_out < MERGE_TOL[dtype] and e_lse < MERGE_TOL[dtype], (dtype, e_out, e_lse)


def test_a_side_that_saw_no_key_has_weight_zero():
    rng = np.random.default_rng(1)
    out1, lse1 = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 4))
    empty_out, empty_lse = np.zeros((2, 4, 8)), np.full((2, 4), -np.inf)
    with np.errstate(all="raise"):
        for a, b in [((out1, lse1), (empty_out, empty_lse)), ((empty_out, empty_lse), (out1, lse1))]:
            out, lse = RA.merge_partials(*a, *b)
            assert np.array_equal(out, out1) and np.array_equal(lse, lse1)
        out, lse = RA.merge_partials(empty_out, empty_lse, empty_out, empty_lse)
        assert np.array_equal(out, empty_out) and np.all(lse == -np.inf)
        # the out of an empty side is ignored, even a NaN
        out, lse = RA.merge_partials(np.full_like(out1, np.nan), empty_lse, out1, lse1)
        assert np.array_equal(out, out1) and np.array_equal(lse, lse1)
        # some rows empty, some not
        half = np.where(np.arange(4) < 2, lse1, -np.inf)
        out, lse = RA.merge_partials(out1, half, empty_out, empty_lse)
        assert np.array_equal(out[:, :2], out1[:, :2]) and np.all(out[:, 2:] == 0) and np.all(lse[:, 2:] == -np.inf)


def equal_weights(out1, lse1, out2, lse2):
    return (out1 + out2) / 2, np.logaddexp(lse1, lse2)


def no_max_subtracted(out1, lse1, out2, lse2):
    w1, w2 = np.exp(lse1), np.exp(lse2)
    return (w1[..., None] * out1 + w2[..., None] * out2) / (w1 + w2)[..., None], np.log(w1 + w2)


def not_renormalised(out1, lse1, out2, lse2):
    m = np.maximum(lse1, lse2)
    w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)
    return w1[..., None] * out1 + w2[..., None] * out2, m + np.log(w1 + w2)


@pytest.mark.parametrize(
    "merge, scale, causal",
    [(equal_weights, 1.0, False), (not_renormalised, 1.0, False), (no_max_subtracted, 300.0, False)],
)
def test_planted_wrong_merges_fail_the_comparison(merge, scale, causal):
    q, k, v, _ = qkv(scale=scale)
    e_out, e_lse = merge_error(merge, q, k, v, causal, 6)
    assert max(e_out, e_lse) > 1e-2, (merge.__name__, e_out, e_lse)
    e_out, e_lse = merge_error(RA.merge_partials, q, k, v, causal, 6)  # the same inputs, the right merge
    assert max(e_out, e_lse) < MERGE_TOL[np.float64]


def test_the_max_is_needed_only_for_large_scores():
    """no_max_subtracted is right on small scores (it is the same formula) and overflows (NaN) on large ones."""
    q, k, v, _ = qkv()
    assert max(merge_error(no_max_subtracted, q, k, v, False, 6)) < 1e-12
    q, k, v, _ = qkv(scale=300.0)
    assert merge_error(no_max_subtracted, q, k, v, False, 6)[0] == np.inf


# ---- the ring, simulated ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_simulated_ring_is_one_rank_causal_attention(dtype, N):
    q, k, v, dout = qkv(dtype=dtype)
    ref, cache = sdpa_forward(q, k, v, causal=True)
    out, lse, log = RA.simulate_ring_attention(q, k, v, N)
    assert out.dtype == lse.dtype == dtype
    assert rel_err(out, ref) < RING_TOL[dtype] and rel_err(lse, cache["lse"]) < RING_TOL[dtype]
    dq, dk, dv, blog = RA.simulate_ring_attention_backward(dout, q, k, v, N)
    for got, want in zip((dq, dk, dv), sdpa_backward(dout, cache)):
        assert got.dtype == dtype and rel_err(got, want) < RING_TOL[dtype]
    # the steps: rank r meets key block (r - s) mod N at step s; full below the diagonal, causal on it, skip above
    assert log == blog and len(log) == N
    for s, step in enumerate(log):
        assert [(r, j) for r, j, _ in step] == [(r, (r - s) % N) for r in range(N)]
        assert all(kind == RA.step_kind(r, j) for r, j, kind in step)
    kinds = [kind for step in log for _, _, kind in step]
    assert kinds.count("causal") == N and kinds.count("skip") == kinds.count("full") == N * (N - 1) // 2


def test_one_rank_is_sdpa_exactly():
    q, k, v, _ = qkv()
    ref, cache = sdpa_forward(q, k, v, causal=True)
    out, lse, _ = RA.simulate_ring_attention(q, k, v, 1)
    assert np.array_equal(out, ref) and np.array_equal(lse, cache["lse"])


def test_non_causal_ring_is_full_attention():
    q, k, v, dout = qkv()
    ref, cache = sdpa_forward(q, k, v, causal=False)
    out, _, log = RA.simulate_ring_attention(q, k, v, 3, causal=False)
    assert rel_err(out, ref) < 1e-12 and all(kind == "full" for step in log for _, _, kind in step)
    grads = RA.simulate_ring_attention_backward(dout, q, k, v, 3, causal=False)[:3]
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(grads, sdpa_backward(dout, cache)))


def test_the_causal_imbalance():
    assert RA.work_per_rank(4) == [0.5, 1.5, 2.5, 3.5]
    assert RA.work_per_rank(4, causal=False) == [4.0] * 4


@pytest.mark.parametrize(
    "kind",
    [
        lambda r, j, causal=True: "full" if j != r else "causal",  # attends the future blocks
        lambda r, j, causal=True: "causal" if j <= r else "skip",  # a causal square on past blocks too
        lambda r, j, causal=True: "full" if j <= r else "skip",  # no mask on the diagonal
        lambda r, j, causal=True: "causal" if j == r else "skip",  # forgets the past
    ],
    ids=["sees-future", "masks-past", "diagonal-unmasked", "forgets-past"],
)
def test_planted_wrong_masks_fail(kind):
    q, k, v, dout = qkv()
    ref, cache = sdpa_forward(q, k, v, causal=True)
    out, _, _ = RA.simulate_ring_attention(q, k, v, 3, kind=kind)
    assert rel_err(out, ref) > 1e-2
    dq = RA.simulate_ring_attention_backward(dout, q, k, v, 3, kind=kind)[0]
    assert rel_err(dq, sdpa_backward(dout, cache)[0]) > 1e-2


def test_real_ring_on_one_rank():
    """The driver over a communicator (SingleComm: world 1; 2 and 4 MPI ranks in test_ring_attention_ranks.py)."""
    q, k, v, dout = qkv()
    ref, cache = sdpa_forward(q, k, v, causal=True)
    out, lse = RA.ring_attention_forward(SingleComm(), q, k, v)
    assert np.array_equal(out, ref) and np.array_equal(lse, cache["lse"])
    grads = RA.ring_attention_backward(SingleComm(), dout, q, k, v, out, lse)
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(grads, sdpa_backward(dout, cache)))


def test_self_check_on_one_rank(tmp_path):
    res = RA.main(["--seq", "8", "--save", str(tmp_path)], comm=SingleComm())
    assert res["ok"] and [c["dtype"] for c in res["checks"]] == ["float64", "float32"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0_float32.npz", "rank0_float64.npz"]


# ---- refusals --------------------------------------------------------------------------------------------------


def test_memory_on_one_rank_is_the_model_and_the_model_adds_up():
    """One rank: the measured allocations of forward + backward within 10% of memory_model (measured 0.01-0.7% over);
    the model's phases are its formula (X = B nh T/N hs, L = B nh T/N elements), the scores shrink N^2 times and the
    planted keep-blocks self-check leaves the numbers right (its memory is tested on 4 MPI ranks)."""
    mem = RA.measure_memory(SingleComm(), batch=1, n_head=2, seq=128, head_size=16)
    m = mem["model"]
    assert mem["ok"] and 1.0 <= mem["ratio"][0] <= 1.0 + RA.MEMORY_TOLERANCE
    X, L = 1 * 2 * 128 * 16 * 8, 1 * 2 * 128 * 8
    assert (m["X"], m["L"], m["scores_block"]) == (X, L, 2 * 128 * 128 * 8)
    assert (
        m["phases"]["forward exchange"] == X + L + 4 * X and m["phases"]["backward exchange"] == 2 * X + 2 * L + 8 * X
    )
    assert m["phases"]["backward step"] == 2 * X + 2 * L + 4 * X + m["step_backward"]
    assert m["step_backward"] > 2 * m["scores_block"]  # the recomputed P and dS at least
    m4 = RA.memory_model(1, 2, 128, 16, 4)
    assert m4["scores_block"] * 16 == m["scores_block"] and m4["peak"] < m["peak"] / 4
    res = RA.main(["--seq", "16", "--plant", "keep-blocks"], comm=SingleComm())
    assert res["ok"] and RA.block_attention.__name__ == "block_attention"  # the plant is undone


def test_a_sequence_that_does_not_split_is_refused():
    q, k, v, dout = qkv(shape=(1, 2, 10, 4))
    with pytest.raises(ValueError, match=r"T=10 positions do not split into N=4 equal blocks"):
        RA.simulate_ring_attention(q, k, v, 4)
    with pytest.raises(ValueError, match=r"T=10 .* N=3"):
        RA.simulate_ring_attention_backward(dout, q, k, v, 3)
    for N in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="N \\(the number of ranks\\) must be a positive int"):
            RA.simulate_ring_attention(q, k, v, N)


def test_bad_shapes_are_named():
    q, k, v, dout = qkv(shape=(1, 2, 8, 4))
    with pytest.raises(ValueError, match=r"simulate_ring_attention: q must be 4-D \(B, nh, T, hs\)"):
        RA.simulate_ring_attention(q[0], k, v, 2)
    with pytest.raises(ValueError, match=r"k \(1, 2, 6, 4\) .* must have one shape"):
        RA.simulate_ring_attention(q, k[:, :, :6], v, 2)
    with pytest.raises(TypeError, match="one dtype"):
        RA.simulate_ring_attention(q, k.astype(np.float32), v, 2)
    with pytest.raises(TypeError, match="v must be a floating-point array"):
        RA.ring_attention_forward(SingleComm(), q, k, v.astype(int))
    with pytest.raises(ValueError, match=r"dout has shape \(1, 2, 8, 3\), expected \(1, 2, 8, 4\)"):
        RA.simulate_ring_attention_backward(dout[..., :3], q, k, v, 2)
    out, lse = RA.ring_attention_forward(SingleComm(), q, k, v)
    with pytest.raises(ValueError, match=r"lse has shape \(1, 2, 8, 4\), expected \(1, 2, 8\)"):
        RA.ring_attention_backward(SingleComm(), dout, q, k, v, out, out)
    with pytest.raises(ValueError, match="merge_partials: out1 has shape"):
        RA.merge_partials(out, lse, out[..., :2], lse)
    with pytest.raises(ValueError, match=r"merge_partials: lse1 .* \(one lse per query\)"):
        RA.merge_partials(out, out, out, lse)
    with pytest.raises(ValueError, match="kind must be one of"):
        RA.block_attention(q, k, v, "half")
