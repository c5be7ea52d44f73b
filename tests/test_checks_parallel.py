"""Lesson 10's checkers: the right answers pass, each plausible mistake fails with the hint that names it, not
attempted / error are reported (never raised)."""
import numpy as np
import pytest

from gpullm_lessons import parallel as P
from gpullm_lessons.checks_parallel import (check_ring_allreduce_sim, check_shard_bounds, check_shard_decay_table,
                                            ring_variant)

SEEDS = range(5)


# ---- 10.1 ----------------------------------------------------------------------------------------------------------

def ring_right(chunks):
    return P.ring_allreduce_chunks(chunks)


def ring_only_reduce_scatter(chunks):
    return ring_variant(chunks, ag_steps=0)


def ring_rs_off_by_one(chunks):
    return ring_variant(chunks, rs=lambda r, s, N: (r - s - 1) % N)


def ring_ag_off_by_one(chunks):
    return ring_variant(chunks, ag=lambda r, s, N: (r - s) % N)


def ring_ag_adds(chunks):
    return ring_variant(chunks, ag_add=True)


def ring_n_steps(chunks):
    N = len(chunks)
    return ring_variant(chunks, rs_steps=N, ag_steps=N)


def ring_short_log(chunks):
    out, log = P.ring_allreduce_chunks(chunks)
    return out, log[:-1]


def ring_direct_sum(chunks):
    N = len(chunks)
    out = np.broadcast_to(chunks.sum(axis=0), chunks.shape).copy()
    log = [[(r, (r + 1) % N, r) for r in range(N)] for _ in range(2 * (N - 1))]
    return out, log


def ring_to_left(chunks):
    out, log = P.ring_allreduce_chunks(chunks)
    N = len(chunks)
    return out, [[(s, (s - 1) % N, c) for s, _, c in step] for step in log]


@pytest.mark.parametrize("seed", SEEDS)
def test_ring_right_passes(seed):
    assert check_ring_allreduce_sim(ring_right, seed=seed, quiet=True).status == "correct"


@pytest.mark.parametrize("fn, hint", [
    (ring_only_reduce_scatter, "only the reduce-scatter was done"),
    (ring_rs_off_by_one, "off-by-one chunk index in the reduce-scatter"),
    (ring_ag_off_by_one, "off-by-one chunk index in the all-gather"),
    (ring_ag_adds, "the all-gather ADDS"),
    (ring_n_steps, "wrong number of steps"),
    (ring_short_log, "wrong number of steps"),
    (ring_direct_sum, "replaying your log"),
    (ring_to_left, "right neighbour"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_ring_mistakes_are_named(fn, hint, seed):
    res = check_ring_allreduce_sim(fn, seed=seed, quiet=True)
    assert res.status == "wrong", res.message
    assert hint in res.message, res.message


def test_ring_not_attempted_and_error(capsys):
    def stub(chunks):
        raise NotImplementedError

    def broken(chunks):
        return chunks[99]

    assert check_ring_allreduce_sim(stub).status == "not attempted"
    res = check_ring_allreduce_sim(broken)
    assert res.status == "error" and "IndexError" in res.message
    assert "seed" in capsys.readouterr().out
    with pytest.raises(TypeError, match="without calling it"):
        check_ring_allreduce_sim(ring_right(np.zeros((2, 2, 1))))


# ---- 10.2 ----------------------------------------------------------------------------------------------------------

def bounds_right(n, world, rank):
    return P.shard_bounds(n, world, rank)


def bounds_floor(n, world, rank):                  # n // world each: the remainder is lost
    S = n // world
    return rank * S, (rank + 1) * S


def bounds_last_takes_rest(n, world, rank):
    S = n // world
    return rank * S, (n if rank == world - 1 else (rank + 1) * S)


def bounds_array_split(n, world, rank):            # np.array_split: the first n % world one longer
    b = P.chunk_bounds(n, world)
    return b[rank]


def bounds_unclipped(n, world, rank):
    S = -(-n // world)
    return rank * S, (rank + 1) * S


def bounds_overlap(n, world, rank):
    S = -(-n // world)
    return min(rank * S, n), min((rank + 1) * S + 1, n)


@pytest.mark.parametrize("seed", SEEDS)
def test_shard_bounds_right_passes(seed):
    assert check_shard_bounds(bounds_right, seed=seed, quiet=True).status == "correct"


@pytest.mark.parametrize("fn, hint", [
    (bounds_floor, "misses the remainder"),
    (bounds_last_takes_rest, "the last shard took the remainder"),
    (bounds_array_split, "uneven shards"),
    (bounds_unclipped, "runs past n"),
    (bounds_overlap, "overlap"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_shard_bounds_mistakes_are_named(fn, hint, seed):
    res = check_shard_bounds(fn, seed=seed, quiet=True)
    assert res.status == "wrong", res.message
    assert hint in res.message, res.message


# ---- 10.3 ----------------------------------------------------------------------------------------------------------

def table_right(bounds, flags, lo, hi):
    return P.shard_decay_table(bounds, flags, lo, hi)


def table_keeps_empty(bounds, flags, lo, hi):       # empty ranges kept: allowed
    return np.clip(bounds - lo, 0, hi - lo), flags


def table_unshifted(bounds, flags, lo, hi):
    return np.clip(bounds, lo, hi), flags


def table_unclipped(bounds, flags, lo, hi):
    return bounds - lo, flags


def table_whole(bounds, flags, lo, hi):
    return bounds, flags


def table_flags_out_of_step(bounds, flags, lo, hi):
    b = np.clip(bounds - lo, 0, hi - lo)
    keep = np.diff(b) > 0
    return np.concatenate([[0], b[1:][keep]]), flags[:keep.sum()]   # bounds dropped, the first flags kept


@pytest.mark.parametrize("fn", [table_right, table_keeps_empty])
@pytest.mark.parametrize("seed", SEEDS)
def test_table_right_passes(fn, seed):
    assert check_shard_decay_table(fn, seed=seed, quiet=True).status == "correct"


@pytest.mark.parametrize("fn, hint", [
    (table_unshifted, "not shifted"),
    (table_unclipped, "not clipped"),
    (table_whole, "shift every bound by -lo"),
    (table_flags_out_of_step, "out of step"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_table_mistakes_are_named(fn, hint, seed):
    res = check_shard_decay_table(fn, seed=seed, quiet=True)
    assert res.status == "wrong", res.message
    assert hint in res.message, res.message
