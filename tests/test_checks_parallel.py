"""Lesson 10's checkers: the right answers pass; each plausible mistake fails, whatever the seed, with the hint that
names it; the sizes that expose a mistake are always run (N = 1, 2, 3, 5 ranks, n not a multiple of N, n < world,
n = 0, world = 1, every rank); not attempted / error are reported, never raised."""
import numpy as np
import pytest

from gpullm_lessons import parallel as P
from gpullm_lessons.checks.parallel import (check_ring_allreduce_sim, check_shard_bounds, check_shard_decay_table,
                                            check_zero_reduce_scatter, reduce_scatter_variant, ring_variant)

SEEDS = range(5)


# ---- 10.1 the ring all-reduce, simulated ---------------------------------------------------------------------------

def ring_right(buffers):
    return ring_variant(buffers)


def ring_library(buffers):                              # the course's own simulation, through its buffer API
    out, log = P.ring_allreduce_sim(list(buffers))
    return np.array(out), log


def ring_other_offset(buffers):                         # a valid ring that starts one chunk earlier: allowed
    return ring_variant(buffers, rs=lambda r, s, N: (r - s - 1) % N, ag=lambda r, s, N: (r - s) % N)


def ring_one_loop(buffers):                             # the all-gather continuing the same rotation
    out = np.array(buffers, dtype=np.float64)
    N, n = out.shape
    b = P.chunk_bounds(n, N)
    log = []
    for k in range(2 * (N - 1)):
        sends = [(r, (r + 1) % N, (r - k) % N) for r in range(N)]
        msgs = [out[r, b[c][0]:b[c][1]].copy() for r, _, c in sends]
        for (r, d, c), m in zip(sends, msgs):
            out[d, b[c][0]:b[c][1]] = out[d, b[c][0]:b[c][1]] + m if k < N - 1 else m
        log.append(sends)
    return out, log


def ring_only_reduce_scatter(buffers):
    return ring_variant(buffers, ag_steps=0)


def ring_ag_wrong_start(buffers):                       # the all-gather starts with the chunk it sent first
    return ring_variant(buffers, ag=lambda r, s, N: (r - s) % N)


def ring_wrong_chunk_at_step_1(buffers):                # step 1 of the reduce-scatter sends its own chunk again
    return ring_variant(buffers, rs=lambda r, s, N: r % N if s == 1 else (r - s) % N)


def ring_same_start(buffers):                           # every rank starts with chunk 0 (and passes it on)
    return ring_variant(buffers, rs=lambda r, s, N: 0)


def ring_ag_adds(buffers):
    return ring_variant(buffers, ag_add=True)


def ring_floor_chunks(buffers):                         # chunks of n // N: the remainder never travels
    return ring_variant(buffers, chunking="floor")


def ring_n_steps(buffers):
    N = len(buffers)
    return ring_variant(buffers, rs_steps=N, ag_steps=N)


def ring_short_log(buffers):
    out, log = ring_variant(buffers)
    return out, log[:-1]


def ring_direct_sum(buffers):                           # the sum, and a made-up log
    N = len(buffers)
    out = np.broadcast_to(np.sum(buffers, axis=0), np.shape(buffers)).copy()
    return out, [[(r, (r + 1) % N, r) for r in range(N)] for _ in range(2 * (N - 1))]


def ring_to_left(buffers):
    out, log = ring_variant(buffers)
    N = len(buffers)
    return out, [[(s, (s - 1) % N, c) for s, _, c in step] for step in log]


_LOG = []


def ring_global_log(buffers):                           # the log kept between calls
    out, log = ring_variant(buffers)
    _LOG.extend(log)
    return out, _LOG


@pytest.mark.parametrize("fn", [ring_right, ring_library, ring_other_offset, ring_one_loop])
@pytest.mark.parametrize("seed", SEEDS)
def test_ring_right_passes(fn, seed):
    r = check_ring_allreduce_sim(fn, seed=seed, quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.parametrize("fn, words", [
    (ring_only_reduce_scatter, "only the reduce-scatter was done"),
    (ring_ag_wrong_start, "the all-gather starts with the wrong chunk"),
    (ring_wrong_chunk_at_step_1, "wrong chunk index at step 1"),
    (ring_same_start, "clashing chunks"),
    (ring_ag_adds, "the all-gather ADDS"),
    (ring_floor_chunks, "the remainder is never sent"),
    (ring_n_steps, "wrong number of steps"),
    (ring_short_log, "wrong number of steps"),
    (ring_direct_sum, "added twice"),
    (ring_to_left, "right neighbour"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_ring_mistakes_are_named(fn, words, seed):
    res = check_ring_allreduce_sim(fn, seed=seed, quiet=True)
    assert res.status == "wrong", res.message
    assert words in res.message, res.message


def test_ring_wrong_chunk_names_the_step_and_rank():
    res = check_ring_allreduce_sim(ring_wrong_chunk_at_step_1, seed=0, quiet=True)
    assert "reduce-scatter step 1" in res.message and "rank 0 sent chunk 0" in res.message, res.message
    res = check_ring_allreduce_sim(ring_ag_wrong_start, seed=0, quiet=True)
    assert "all-gather step 0" in res.message and "finished chunk" in res.message, res.message


def test_ring_log_kept_between_calls_fails_on_the_second_call():
    _LOG.clear()
    res = check_ring_allreduce_sim(ring_global_log, seed=0, quiet=True)
    assert res.status == "wrong" and "kept between calls" in res.hint and "call 2 of" in res.message, res.message


def test_ring_floor_chunks_used_to_pass_when_n_was_a_multiple():
    """The old checker drew chunks of equal size m: chunks of n // N passed. Every seed now runs n = 11 on 3 ranks."""
    res = check_ring_allreduce_sim(ring_floor_chunks, seed=0, quiet=True)
    assert res.dims["n"] % res.dims["N"], res.dims
    assert "rank" in res.message and "expected" in res.message, res.message


def test_ring_runs_one_rank_and_fewer_elements_than_ranks():
    seen = []

    def spy(buffers):
        seen.append(np.shape(buffers))
        return ring_variant(buffers)
    assert check_ring_allreduce_sim(spy, seed=3, quiet=True).status == "correct"
    assert (1, 4) in seen and (5, 3) in seen and (2, 7) in seen and len(seen) >= 5


def test_ring_not_attempted_and_error(capsys):
    def stub(buffers):
        raise NotImplementedError

    def broken(buffers):
        return buffers[99]

    assert check_ring_allreduce_sim(stub).status == "not attempted"
    res = check_ring_allreduce_sim(broken)
    assert res.status == "error" and "IndexError" in res.message and "call 1 of" in res.hint
    assert "seed" in capsys.readouterr().out
    with pytest.raises(TypeError, match="without calling it"):
        check_ring_allreduce_sim(ring_right(np.zeros((2, 2))))


# ---- 10.2 shard bounds ---------------------------------------------------------------------------------------------

def bounds_right(n, world, rank):
    return P.shard_bounds(n, world, rank)


def bounds_lo_unclipped(n, world, rank):        # hi clipped, lo not: wrong only where rank * S > n
    S = -(-n // world)
    return rank * S, min((rank + 1) * S, n)


def bounds_unclipped(n, world, rank):
    S = -(-n // world)
    return rank * S, (rank + 1) * S


def bounds_floor(n, world, rank):               # n // world each: the remainder is lost
    S = n // world
    return rank * S, (rank + 1) * S


def bounds_last_takes_rest(n, world, rank):
    S = n // world
    return rank * S, (n if rank == world - 1 else (rank + 1) * S)


def bounds_array_split(n, world, rank):         # np.array_split: the first n % world one longer
    return P.chunk_bounds(n, world)[rank]


def bounds_inclusive(n, world, rank):
    lo, hi = P.shard_bounds(n, world, rank)
    return lo, hi - 1


def bounds_plus_one(n, world, rank):            # n // world + 1: one too many when world divides n
    S = n // world + 1
    return min(rank * S, n), min((rank + 1) * S, n)


def bounds_empty_at_zero(n, world, rank):
    lo, hi = P.shard_bounds(n, world, rank)
    return (0, 0) if lo == hi else (lo, hi)


def bounds_overlap(n, world, rank):
    S = -(-n // world)
    return min(rank * S, n), min((rank + 1) * S + 1, n)


def bounds_floats(n, world, rank):
    S = -(-n // world)
    return float(min(rank * S, n)), float(min((rank + 1) * S, n))


@pytest.mark.parametrize("seed", SEEDS)
def test_shard_bounds_right_passes(seed):
    assert check_shard_bounds(bounds_right, seed=seed, quiet=True).status == "correct"


@pytest.mark.parametrize("fn, words", [
    (bounds_lo_unclipped, "the lower end is not clipped"),
    (bounds_unclipped, "not clipped to n"),
    (bounds_floor, "misses the remainder"),
    (bounds_last_takes_rest, "the last shard took the remainder"),
    (bounds_array_split, "np.array_split"),
    (bounds_inclusive, "hi is inclusive"),
    (bounds_plus_one, "n // world + 1"),
    (bounds_empty_at_zero, "AT n"),
    (bounds_overlap, "overlap"),
    (bounds_floats, "integer arithmetic"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_shard_bounds_mistakes_are_named(fn, words, seed):
    res = check_shard_bounds(fn, seed=seed, quiet=True)
    assert res.status == "wrong", res.message
    assert words in res.message, res.message


def test_unclipped_lower_bound_fails_on_every_seed_at_n_below_world():
    """It used to pass unless n < world was drawn: (3, 5) and (9, 6) now run on every call."""
    for seed in range(20):
        res = check_shard_bounds(bounds_lo_unclipped, seed=seed, quiet=True)
        assert res.status == "wrong" and "lower end is not clipped" in res.hint, res.message
        assert "rank" in res.message and "expected" in res.message


def test_shard_bounds_runs_the_edge_cases_every_time():
    seen = set()

    def spy(n, world, rank):
        seen.add((n, world))
        return bounds_right(n, world, rank)
    check_shard_bounds(spy, seed=11, quiet=True)
    assert {(3, 5), (9, 6), (0, 3), (7, 1), (1, 1)} <= seen
    assert any(n % w for n, w in seen if n > w) and any(n % w == 0 and n > w for n, w in seen)


def test_shard_bounds_error_and_not_attempted():
    def todo(n, world, rank):
        raise NotImplementedError

    def zero_div(n, world, rank):                   # right, but crashes on n = 0
        pieces = -(-n // world)
        assert n // pieces >= 0
        return bounds_right(n, world, rank)
    assert check_shard_bounds(todo, quiet=True).status == "not attempted"
    res = check_shard_bounds(zero_div, seed=0, quiet=True)
    assert res.status == "error" and "ZeroDivisionError" in res.message and "rank=" in res.hint


# ---- 10.3 the shard's decay table ---------------------------------------------------------------------------------

def table_right(bounds, flags, lo, hi):
    return P.shard_decay_table(bounds, flags, lo, hi)


def table_keeps_empty(bounds, flags, lo, hi):       # empty ranges kept: allowed
    return np.clip(bounds - lo, 0, hi - lo), flags


def table_unshifted(bounds, flags, lo, hi):
    return np.clip(bounds, lo, hi), flags


def table_unclipped(bounds, flags, lo, hi):
    return bounds - lo, flags


def table_low_only(bounds, flags, lo, hi):
    return np.maximum(bounds - lo, 0), flags


def table_high_only(bounds, flags, lo, hi):
    return np.minimum(bounds - lo, hi - lo), flags


def table_whole(bounds, flags, lo, hi):
    return bounds, flags


def table_off_by_one(bounds, flags, lo, hi):
    return np.clip(bounds - lo, 0, hi - lo - 1), flags


def table_flags_out_of_step(bounds, flags, lo, hi):
    b = np.clip(bounds - lo, 0, hi - lo)
    keep = np.diff(b) > 0
    return np.concatenate([[0], b[1:][keep]]), flags[:keep.sum()]   # bounds dropped, the first flags kept


def table_no_empty_shard(bounds, flags, lo, hi):    # crashes on an empty shard
    per_element = len(flags) // (int(hi) - int(lo))
    return table_right(bounds, flags, lo, hi) if per_element >= 0 else None


@pytest.mark.parametrize("fn", [table_right, table_keeps_empty])
@pytest.mark.parametrize("seed", SEEDS)
def test_table_right_passes(fn, seed):
    res = check_shard_decay_table(fn, seed=seed, quiet=True)
    assert res.status == "correct", res.message


@pytest.mark.parametrize("fn, words", [
    (table_unshifted, "not shifted"),
    (table_unclipped, "not clipped: a tensor"),
    (table_low_only, "not clipped at the top"),
    (table_high_only, "not clipped at the bottom"),
    (table_whole, "the whole buffer's table"),
    (table_off_by_one, "one element short"),
    (table_flags_out_of_step, "out of step"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_table_mistakes_are_named(fn, words, seed):
    res = check_shard_decay_table(fn, seed=seed, quiet=True)
    assert res.status == "wrong", res.message
    assert words in res.message, res.message


def test_table_runs_an_empty_shard_and_every_rank():
    seen = []

    def spy(bounds, flags, lo, hi):
        seen.append((int(bounds[-1]), lo, hi))
        return table_right(bounds, flags, lo, hi)
    assert check_shard_decay_table(spy, seed=0, quiet=True).status == "correct"
    assert any(lo == hi for _, lo, hi in seen) and any(lo == 0 for _, lo, _ in seen)
    assert any(hi == n for n, _, hi in seen) and len({n for n, _, _ in seen}) == 2
    res = check_shard_decay_table(table_no_empty_shard, seed=0, quiet=True)
    assert res.status == "error" and "(empty)" in res.hint, res.message


# ---- 10.4 ZeRO's reduce-scatter over sendrecv ---------------------------------------------------------------------

def _shard(grad, k, S):
    return grad[k * S:(k + 1) * S]


def rs_right(comm, grad, out):
    N, r, S = comm.world_size, comm.rank, out.size
    tmp = np.empty(S)
    for s in range(N - 1):
        comm.sendrecv(_shard(grad, (r - s - 1) % N, S), (r + 1) % N, tmp, (r - 1) % N)
        _shard(grad, (r - s - 2) % N, S)[...] += tmp
    out[...] = _shard(grad, r, S)


def rs_lesson_schedule(comm, grad, out):            # ends with chunk r + 1, as the lesson's reduce-scatter
    N, r, S = comm.world_size, comm.rank, out.size
    tmp = np.empty(S)
    for s in range(N - 1):
        comm.sendrecv(_shard(grad, (r - s) % N, S), (r + 1) % N, tmp, (r - 1) % N)
        _shard(grad, (r - s - 1) % N, S)[...] += tmp
    out[...] = _shard(grad, (r + 1) % N, S)


def rs_lesson_schedule_own(comm, grad, out):        # the lesson's schedule, reading its own shard
    N, r, S = comm.world_size, comm.rank, out.size
    tmp = np.empty(S)
    for s in range(N - 1):
        comm.sendrecv(_shard(grad, (r - s) % N, S), (r + 1) % N, tmp, (r - 1) % N)
        _shard(grad, (r - s - 1) % N, S)[...] += tmp
    out[...] = _shard(grad, r, S)


def rs_overwrite(comm, grad, out):                  # receives straight into the shard: no addition
    N, r, S = comm.world_size, comm.rank, out.size
    for s in range(N - 1):
        comm.sendrecv(_shard(grad, (r - s - 1) % N, S), (r + 1) % N, _shard(grad, (r - s - 2) % N, S), (r - 1) % N)
    out[...] = _shard(grad, r, S)


def rs_rebinds_out(comm, grad, out):
    rs_right(comm, grad, np.empty_like(out))
    out = _shard(grad, comm.rank, out.size).copy()  # noqa: F841 - the mistake


def rs_mean(comm, grad, out):
    rs_right(comm, grad, out)
    out /= comm.world_size


def rs_extra_step_on_rank_0(comm, grad, out):
    rs_right(comm, grad, out)
    if comm.rank == 0 and comm.world_size > 1:
        comm.sendrecv(_shard(grad, 0, out.size), 1, np.empty(out.size), comm.world_size - 1)


def rs_n_steps(comm, grad, out):                    # one step too many
    N, r, S = comm.world_size, comm.rank, out.size
    tmp = np.empty(S)
    for s in range(N):
        comm.sendrecv(_shard(grad, (r - s - 1) % N, S), (r + 1) % N, tmp, (r - 1) % N)
        _shard(grad, (r - s - 2) % N, S)[...] += tmp
    out[...] = _shard(grad, r, S)


def rs_to_left(comm, grad, out):
    N, r, S = comm.world_size, comm.rank, out.size
    tmp = np.empty(S)
    for s in range(N - 1):
        comm.sendrecv(_shard(grad, (r + s + 1) % N, S), (r - 1) % N, tmp, (r + 1) % N)
        _shard(grad, (r + s + 2) % N, S)[...] += tmp
    out[...] = _shard(grad, r, S)


def rs_collective(comm, grad, out):
    comm.reduce_scatter(grad, out)


_SCRATCH = {}


def rs_scratch_kept(comm, grad, out):               # a scratch buffer sized on the first call, kept
    tmp = _SCRATCH.setdefault(comm.rank, np.empty(out.size))
    N, r, S = comm.world_size, comm.rank, out.size
    for s in range(N - 1):
        comm.sendrecv(_shard(grad, (r - s - 1) % N, S), (r + 1) % N, tmp, (r - 1) % N)
        _shard(grad, (r - s - 2) % N, S)[...] += tmp
    out[...] = _shard(grad, r, S)


@pytest.mark.parametrize("seed", SEEDS)
def test_reduce_scatter_right_passes(seed):
    res = check_zero_reduce_scatter(rs_right, seed=seed, quiet=True)
    assert res.status == "correct", res.message


def test_reduce_scatter_variant_is_zeros_reduce_scatter():
    rng = np.random.default_rng(0)
    for N, S in ((1, 3), (2, 2), (3, 1), (5, 4)):
        grads = rng.integers(-9, 10, (N, N * S)).astype(np.float64)
        g, last = reduce_scatter_variant(grads, S)
        assert last == list(range(N))
        for r in range(N):
            np.testing.assert_array_equal(g[r, r * S:(r + 1) * S], grads.sum(axis=0)[r * S:(r + 1) * S])


@pytest.mark.parametrize("fn, words", [
    (rs_lesson_schedule, "lesson's reduce-scatter finishes chunk r + 1"),
    (rs_lesson_schedule_own, "never receives chunk r"),
    (rs_overwrite, "overwrites instead of being added"),
    (rs_rebinds_out, "only rebinds the name"),
    (rs_mean, "you averaged"),
    (rs_extra_step_on_rank_0, "leaves its neighbour waiting"),
    (rs_n_steps, "one step too many"),
    (rs_to_left, "right neighbour"),
    (rs_collective, "use only comm.sendrecv"),
])
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_reduce_scatter_mistakes_are_named(fn, words, seed):
    res = check_zero_reduce_scatter(fn, seed=seed, quiet=True, timeout=0.3)
    assert res.status == "wrong", res.message
    assert words in res.message, res.message


def test_reduce_scatter_stale_scratch_fails_on_a_later_call():
    _SCRATCH.clear()
    res = check_zero_reduce_scatter(rs_scratch_kept, seed=0, quiet=True, timeout=0.3)
    assert res.status == "wrong" and "recv_buf holds" in res.message and "call 2 of" in res.message, res.message


def test_reduce_scatter_names_the_rank_and_the_wait():
    res = check_zero_reduce_scatter(rs_extra_step_on_rank_0, seed=0, quiet=True, timeout=0.3)
    assert "rank 0 waited" in res.message and "calls per rank" in res.message, res.message


def test_reduce_scatter_not_attempted_and_error_on_one_rank(capsys):
    def todo(comm, grad, out):
        raise NotImplementedError

    def boom(comm, grad, out):
        if comm.rank == 1:
            raise IndexError("boom")
        rs_right(comm, grad, out)
    assert check_zero_reduce_scatter(todo, quiet=True).status == "not attempted"
    res = check_zero_reduce_scatter(boom, seed=0, timeout=0.3)
    assert res.status == "error" and "IndexError: boom" in res.message and "on rank 1" in res.hint
    assert "seed 0" in capsys.readouterr().out


def test_reduce_scatter_runs_one_rank_and_five():
    seen = set()

    def spy(comm, grad, out):
        seen.add((comm.world_size, out.size))
        rs_right(comm, grad, out)
    assert check_zero_reduce_scatter(spy, seed=0, quiet=True).status == "correct"
    assert {(1, 4), (2, 3), (5, 3)} <= seen


# ---- shared behaviour ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("check, fn", [(check_ring_allreduce_sim, ring_right), (check_shard_bounds, bounds_right),
                                       (check_shard_decay_table, table_right), (check_zero_reduce_scatter, rs_right)])
def test_same_seed_same_verdict_and_bad_arguments(check, fn):
    a, b = check(fn, seed=7, quiet=True), check(fn, seed=7, quiet=True)
    assert a.message == b.message and "seed 7" in a.message
    with pytest.raises(TypeError):
        check(3)
    with pytest.raises(TypeError):
        check(fn, seed=-1)


def test_records_for_grading(tmp_path, monkeypatch):
    import json
    from gpullm_lessons.classroom import grading
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(grading.LOG_ENV, str(log))
    check_ring_allreduce_sim(ring_right, task="10.1 ring all-reduce schedule", quiet=True)
    check_shard_bounds(bounds_lo_unclipped, task="10.2 ZeRO-1 shard bounds", quiet=True)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["task"], e["status"]) for e in entries] == [("10.1 ring all-reduce schedule", "correct"),
                                                          ("10.2 ZeRO-1 shard bounds", "wrong")]
