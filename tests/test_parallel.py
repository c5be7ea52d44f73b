"""Data parallel and ZeRO-1 (parallel.py): the ring simulated and across MPI ranks, shard bookkeeping, and training
on 2 MPI ranks against the one-rank run (CI: CPU, NumPy engine); the same on 2 GPUs with NCCL (gpu-marked)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gpullm_lessons import parallel as P
from gpullm_lessons.runtime.arrays import to_numpy
from gpullm_lessons.parallel.comm import SingleComm
from gpullm_lessons.model.params import GPTConfig, ParamBuffer, num_params

from test_comm import ROOT, gpus, run_mpi

TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--block-size", "16", "--batch-size", "8",
        "--steps", "5", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]


def losses(out):
    return np.array([json.loads(line)["loss"] for line in open(os.path.join(out, "log.jsonl"))])


# ---- the ring, simulated ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N", [1, 2, 3, 4, 5])
def test_ring_sim_sums_in_2_N_minus_1_steps(N):
    rng = np.random.default_rng(N)
    n = 7 * N + 3                                            # not a multiple of N: uneven chunks
    bufs = [rng.standard_normal(n) for _ in range(N)]
    results, log = P.ring_allreduce_sim(bufs)
    assert len(log) == 2 * (N - 1)
    for r in range(N):
        np.testing.assert_allclose(results[r], np.sum(bufs, axis=0), rtol=1e-12)
    for step in log:                                          # every rank sends one chunk to its right neighbour
        assert sorted(src for src, _, _ in step) == list(range(N))
        assert all(dst == (src + 1) % N for src, dst, _ in step)
    final = P.ring_contributions(N, log)[-1]
    assert all(final[r][c] == frozenset(range(N)) for r in range(N) for c in range(N))


def test_chunk_bounds_cover_the_buffer():
    b = P.chunk_bounds(10, 3)
    assert b == [(0, 4), (4, 7), (7, 10)]
    assert P.chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


# ---- ZeRO-1 bookkeeping -------------------------------------------------------------------------------------------

def test_shards_and_their_decay_tables():
    from gpullm_lessons.kernels.numba.adamw import decay_table
    from gpullm_lessons.model.optim import decay_mask_for

    cfg = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=2, d_model=6)
    n = num_params(cfg)
    bounds, flags = decay_table(ParamBuffer(cfg), arrays="numpy")
    full = decay_mask_for(cfg)
    for W in (1, 2, 3, 5):
        for align in (1, 64):
            S = P.shard_size(n, W, align)
            assert S * W >= n and S % align == 0
            covered = []
            for r in range(W):
                lo, hi = P.shard_bounds(n, W, r, align)
                covered += list(range(lo, hi))
                b, f = P.shard_decay_table(bounds, flags, r * S, (r + 1) * S)   # the padded shard, as ZeRO uses it
                assert b[0] == 0 and b[-1] == S and len(f) == len(b) - 1
                mask = np.repeat(f.astype(bool), np.diff(b))
                padded = np.zeros(W * S, bool)
                padded[:n] = full
                assert np.array_equal(mask, padded[r * S:(r + 1) * S])
            assert covered == list(range(n))


def test_zero_memory_table():
    rows = P.zero_memory_table(1000, worlds=(1, 2, 4))
    assert [r["zero1_optimizer"] for r in rows] == [8000, 4000, 2000]
    assert all(r["dp_optimizer"] == 8000 for r in rows)
    assert [r["zero2_grads"] for r in rows] == [4000, 2000, 1000] and all(r["zero1_grads"] == 4000 for r in rows)
    assert [r["zero1_total"] - r["zero2_total"] for r in rows] == [0, 2000, 3000]


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_memory_is_what_the_rank_holds(zero):
    """memory() counts the arrays a rank holds between steps: ZeRO-1 the padded local gradient and the reduced shard,
    ZeRO-2 the shard only (the local buffer exists from backward to the reduce-scatter)."""
    from gpullm_lessons import engine

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
    eng = engine.build(cfg, "numpy", seed=1)
    dp = P.DataParallel(eng, SingleComm(), zero=zero)
    S = P.shard_size(num_params(cfg), 1, 64)
    rng = np.random.default_rng(0)
    for _ in range(2):
        dp.train_step(rng.integers(0, 32, (4, 8)), rng.integers(0, 32, (4, 8)), lr=1e-2)
        assert dp.memory()["grads"] == 4 * S * (2 if zero == 1 else 1)
        assert (eng.grads is None) == (zero == 2)


# ---- buckets in backward order, and the all-reduce overlapped with backward ------------------------------------------

def test_layer_segments_cover_the_buffer_once():
    from gpullm_lessons.model.params import layer_segments

    cfg = GPTConfig(vocab_size=11, block_size=5, n_layer=3, n_head=2, d_model=6)
    layers = layer_segments(cfg)
    assert len(layers) == cfg.n_layer + 2 and [len(seg) for seg in layers] == [2, 12, 12, 12, 2]
    hit = np.zeros(num_params(cfg), int)
    for seg in layers:
        for _, lo, hi in seg:
            hit[lo:hi] += 1
    assert (hit == 1).all()
    p = ParamBuffer(cfg)
    assert layers[2][4][1:] == (p.offsets["attprojw"][0] + 36, p.offsets["attprojw"][0] + 72)  # block 1's attprojw


def test_assign_buckets_in_backward_order():
    assert P.assign_buckets([3, 1, 2, 4], 6) == [[3, 2], [1, 0]]          # 4 + 2 = 6 fits exactly; then 1 + 3
    assert P.assign_buckets([3, 1, 2, 4], 5) == [[3], [2, 1], [0]]
    assert P.assign_buckets([10, 1, 1], 4) == [[2, 1], [0]]                # larger than the limit: a bucket of its own
    assert P.assign_buckets([5, 5], 100) == [[1, 0]] and P.assign_buckets([], 3) == []
    with pytest.raises(ValueError, match="limit must be at least 1"):
        P.assign_buckets([1], 0)


class TwoRanksInOne(SingleComm):
    """One process posing as 2 ranks whose all-reduce triples the buffer (the mean gradient is 1.5x this rank's own);
    it records each all-reduce's buffer as it was when started."""

    def __init__(self):
        super().__init__()
        self.world_size, self.started = 2, []

    def all_reduce(self, buf, op="sum"):
        buf *= 3

    def all_reduce_async(self, buf, op="sum"):
        self.started.append(buf.copy())
        return super().all_reduce_async(buf, op)

    def all_reduce_scalars(self, values, op="sum"):
        return np.asarray(values, np.float64) * (1 if op == "max" else 2)


@pytest.mark.parametrize("backend, K", [("numpy", 1), ("numpy", 2), ("numba", 1)])
def test_overlapped_buckets_start_in_backward_with_final_gradients(backend, K):
    """The buckets start during backward (the first before the embeddings' gradients exist) and hold final values when
    they start: the step's mean gradient equals the sequential buckets' and 1.5x a plain backward's, bit for bit (numba:
    the kernel engine's backward, in the simulator here)."""
    from gpullm_lessons import engine

    if backend == "numpy":
        cfg, B, T, mb = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16), 4, 8, 0.004
    else:  # the simulator: a toy that runs in seconds
        cfg, B, T, mb = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=1, d_model=8), 2, 4, 0.0005
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))
    plain = engine.build(cfg, backend, seed=1)
    plain.forward_backward(x, y, K)
    want = (plain.grads.flat * np.float32(3)) * np.float32(0.5)
    got = {}
    for overlap in (False, True):
        eng, comm = engine.build(cfg, backend, seed=1), TwoRanksInOne()
        dp = P.DataParallel(eng, comm, bucket_mb=mb, overlap=overlap)      # 1048 / 131 elements: 12 / 10 buckets
        seen = []
        if overlap:
            ready = dp.buckets.ready
            dp.buckets.ready = lambda k: (seen.append((k, len(comm.started))), ready(k))
            dp.buckets.begin(eng.grads.flat)
            eng.forward_backward(x, y, K, grads_ready=dp.buckets.ready)
            dp.buckets.finish(eng.grads.flat)
        else:
            eng.forward_backward(x, y, K)
            dp.mean_gradient(eng.grads.flat)
        got[overlap] = eng.grads.flat.copy()
        assert len(comm.started) == len(dp.buckets) >= 4
        packed = np.zeros_like(dp.buckets.buf)                               # the final local gradient, bucket order
        for i, (_, _, lo, hi) in enumerate(dp.buckets.tensors):
            packed[dp.buckets.pos[i]:dp.buckets.pos[i] + hi - lo] = plain.grads.flat[lo:hi]
        for (a, b), sent in zip(dp.buckets.bounds, comm.started):            # what each all-reduce was given: final
            np.testing.assert_array_equal(to_numpy(sent), to_numpy(packed[a:b]))
    assert [k for k, _ in seen] == [3, 2, 1, 0]                              # final LayerNorm, blocks 1, 0, embeddings
    assert seen[-1][1] >= 2                                                  # buckets started before the last layer
    np.testing.assert_array_equal(to_numpy(got[True]), to_numpy(got[False]))
    np.testing.assert_array_equal(to_numpy(got[True]), to_numpy(want))


def test_overlap_needs_buckets_and_no_zero():
    from gpullm_lessons import engine

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
    for kw in ({"overlap": True}, {"overlap": True, "bucket_mb": 1, "zero": 1}):
        with pytest.raises(ValueError, match="needs bucket_mb > 0 .* and zero=0"):
            P.DataParallel(engine.build(cfg, "numpy"), SingleComm(), **kw)
    with pytest.raises(ValueError, match=r"zero must be one of \(0, 1, 2\)"):
        P.DataParallel(engine.build(cfg, "numpy"), SingleComm(), zero=3)


# ---- one process: DataParallel with one rank is the engine's own step -------------------------------------------

@pytest.mark.parametrize("zero", [False, True])
def test_one_rank_data_parallel_equals_the_engine(zero):
    from gpullm_lessons import engine

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
    ref, eng = engine.build(cfg, "numpy", seed=1), engine.build(cfg, "numpy", seed=1)
    dp = P.DataParallel(eng, SingleComm(), zero=zero, check_every=1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, y = rng.integers(0, 32, (4, 8)), rng.integers(0, 32, (4, 8))
        a = ref.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=0.5)
        b = dp.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=0.5)
        assert a["loss"] == b["loss"]
    np.testing.assert_array_equal(ref.params.flat, eng.params.flat)
    assert dp.steps == 3                                     # counted on one rank too
    if zero:
        assert dp.optimizer_bytes() == 8 * P.shard_size(num_params(cfg), 1, 64)


class SplitComm(SingleComm):
    """A fake two-rank world whose ranks disagree: what check_replicas must catch."""

    def gather_scalars(self, values):
        v = np.asarray(values, np.float64)
        return np.stack([v, v + 1.0])


def test_replica_mismatch_names_the_ranks():
    from gpullm_lessons import engine

    cfg = GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=1, d_model=8)
    dp = P.DataParallel(engine.build(cfg, "numpy"), SingleComm())
    dp.comm, dp.W = SplitComm(), 2
    with pytest.raises(P.ReplicaMismatch, match=r"rank\(s\) \[1\] disagree with rank 0"):
        dp.check_replicas()


def test_batch_must_divide_by_the_ranks():
    from gpullm_lessons.train import ConfigError, main as train_main

    class Three(SingleComm):
        def __init__(self):
            super().__init__()
            self.world_size = 3

    with pytest.raises(ConfigError, match="does not divide by the 3 ranks"):
        train_main(["--backend", "numpy"] + TINY, comm=Three())


# ---- real ranks: MPI on the CPU -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "one"
    p = subprocess.run([sys.executable, "-m", "gpullm_lessons.train", "--backend", "numpy", *TINY, "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    return losses(out)


def test_two_ranks_match_one_rank(one_rank, tmp_path):
    p = run_mpi(2, "gpullm_lessons.parallel", ["train", "--backend", "numpy", *TINY, "--out", str(tmp_path / "dp")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    two = losses(tmp_path / "dp")
    np.testing.assert_allclose(two, one_rank, rtol=1e-5)
    assert "replicas identical" in p.stdout


def test_train_py_hands_over_on_several_ranks(one_rank, tmp_path):
    """mpirun -n 2 python -m gpullm_lessons.train ... is data parallel once train.py calls train_distributed."""
    p = run_mpi(2, "gpullm_lessons.train", ["--backend", "numpy", *TINY, "--out", str(tmp_path / "dp")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "dp"), one_rank, rtol=1e-5)


def test_zero1_matches_data_parallel_and_halves_the_optimizer(tmp_path):
    dp = run_mpi(2, "gpullm_lessons.parallel", ["train", "--backend", "numpy", *TINY, "--out", str(tmp_path / "dp")])
    z = run_mpi(2, "gpullm_lessons.parallel", ["train", "--backend", "numpy", *TINY, "--zero", "--check-every", "2",
                                               "--out", str(tmp_path / "z")])
    z2 = run_mpi(2, "gpullm_lessons.parallel", ["train", "--backend", "numpy", *TINY, "--zero", "2", "--check-every",
                                                "2", "--out", str(tmp_path / "z2")])
    assert dp.returncode == 0 and z.returncode == 0, z.stdout[-3000:] + z.stderr[-3000:]
    assert z2.returncode == 0, z2.stdout[-3000:] + z2.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "z"), losses(tmp_path / "dp"), rtol=1e-6)
    np.testing.assert_array_equal(losses(tmp_path / "z2"), losses(tmp_path / "z"))   # the same arithmetic as ZeRO-1
    pattern = r"rank \d: optimizer state .* unsharded \(([0-9.]+)\); gradient kept .* unsharded \(([0-9.]+)\)"
    z1_ratios = [tuple(map(float, v)) for v in re.findall(pattern, z.stdout)]
    z2_ratios = [tuple(map(float, v)) for v in re.findall(pattern, z2.stdout)]
    assert len(z1_ratios) == len(z2_ratios) == 2, z.stdout + z2.stdout
    assert all(abs(opt - 0.5) < 0.01 and grad > 1.0 for opt, grad in z1_ratios), z.stdout  # full buffer + the shard
    assert all(abs(opt - 0.5) < 0.01 and abs(grad - 0.5) < 0.01 for opt, grad in z2_ratios), z2.stdout
    summary = json.loads((tmp_path / "z2" / "summary.json").read_text())
    S = P.shard_size(summary["num_params"], 2, 64)
    assert summary["zero"] == 2 and summary["gradient_bytes_per_rank"] == [4 * S, 4 * S]
    print("\n".join(line for line in z.stdout.splitlines() + z2.stdout.splitlines() if "optimizer state" in line))


@pytest.mark.parametrize("ranks, extra", [(3, []), (2, ["--grad-accum", "2"])], ids=["3-ranks", "2-ranks-accum"])
def test_overlap_equals_the_sequential_buckets_bitwise(tmp_path, ranks, extra):
    """--overlap gives the losses and the final weights of the same buckets all-reduced after backward, bit for bit
    (3 ranks: a sum whose order matters; with --grad-accum: only the last micro-batch starts buckets)."""
    args = ["train", "--backend", "numpy", *TINY, "--batch-size", "12", "--bucket-mb", "0.02", *extra]
    runs = {}
    for name, flags in (("seq", []), ("overlap", ["--overlap"])):
        p = run_mpi(ranks, "gpullm_lessons.parallel", args + flags + ["--out", str(tmp_path / name)])
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        runs[name] = (losses(tmp_path / name), np.load(tmp_path / name / "ckpt.npz")["params"],
                      json.loads((tmp_path / name / "summary.json").read_text()))
        assert "gradient buckets: 4 of at most 0.02 MiB" in p.stdout
    (ls, ps, ss), (lo, po, so) = runs["seq"], runs["overlap"]
    np.testing.assert_array_equal(lo, ls)
    np.testing.assert_array_equal(po, ps)
    assert ss["buckets_started_during_backward"] == 0 and so["buckets_started_during_backward"] == 2
    recs = [json.loads(line) for line in open(tmp_path / "overlap" / "log.jsonl")]
    assert all(r["comm_s"] > 0 and r["comm_exposed_s"] > 0 for r in recs)


def test_bench_reports_algbw_and_busbw(tmp_path):
    out = tmp_path / "bench.json"
    p = run_mpi(2, "gpullm_lessons.parallel", ["bench", "--max-bytes", str(2**16), "--iters", "3", "--json", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {r["algo"] for r in res["rows"]} == {"mpi", "ring"}
    for r in res["rows"]:
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert "busbw" in p.stdout


# ---- real ranks: 2 GPUs with NCCL -----------------------------------------------------------------------------------

def _gpu_pair():
    if gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {gpus()}")


GPU_TINY = ["--backend", "hip", "--preset", "tiny", "--batch-size", "16", "--steps", "8", "--eval-every", "0",
            "--eval-batches", "2", "--sample-tokens", "0", "--no-progress"]


def _launch2(args, out, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "gpullm_lessons.parallel.launch", "--nproc", "2", "--backend", "nccl", "--module",
                        "gpullm_lessons.parallel", "--", "train", *args, "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.gpu
def test_two_gpus_match_one_gpu(tmp_path):
    _gpu_pair()
    one = subprocess.run([sys.executable, "-m", "gpullm_lessons.train", *GPU_TINY, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert one.returncode == 0, one.stderr[-3000:]
    _launch2(GPU_TINY, tmp_path / "two")
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)


@pytest.mark.gpu
def test_zero1_on_two_gpus_matches_data_parallel(tmp_path):
    _gpu_pair()
    _launch2(GPU_TINY, tmp_path / "dp")
    z = _launch2(GPU_TINY + ["--zero"], tmp_path / "z")
    np.testing.assert_allclose(losses(tmp_path / "z"), losses(tmp_path / "dp"), rtol=1e-5)
    assert "(0.50" in z.stdout, z.stdout


# ---- the data-parallel step as graphs: backward's graph, the all-reduce, the update's graph (one GPU) ---------------

class TripledComm(SingleComm):
    """One process posing as 2 ranks whose all-reduce triples the buffer: the "mean" gradient is 1.5x this rank's own,
    so a step that skips the all-reduce, or runs it after the update, ends with other weights."""

    def __init__(self):
        super().__init__()
        self.world_size = 2

    def all_reduce(self, buf, op="sum"):
        buf *= 3

    def all_reduce_scalars(self, values, op="sum"):
        v = np.asarray(values, np.float64)
        return v if op == "max" else 2 * v

    def gather_scalars(self, values):
        v = np.asarray(values, np.float64)
        return np.stack([v, v])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_data_parallel_graph_steps_equal_eager_ones(precision):
    from gpullm_lessons import engine

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128)
    tol = 1e-5 if precision == "fp32" else 1e-3          # as the one-rank graph test (cuBLAS's algorithm choice)
    runs = {}
    for graphs in ("off", "on"):
        eng = engine.build(cfg, "hip", precision=precision, graphs=graphs, seed=3)
        dp = P.DataParallel(eng, TripledComm())
        rng = np.random.default_rng(0)
        out = []
        for _ in range(4):
            x, y = rng.integers(0, 256, (8, 64)).astype(np.int32), rng.integers(0, 256, (8, 64)).astype(np.int32)
            out.append(dp.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=0.0))   # no clip: m sees the scale
        runs[graphs] = (eng, out)
    (eager, a), (graph, b) = runs["off"], runs["on"]
    assert graph.graphs and len(graph._graphs) == 1 and not eager.graphs
    assert graph.graph_pool_bytes() > 0
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= tol * ra["loss"], (ra, rb)
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= tol * ra["grad_norm"], (ra, rb)
    sa, sb = eager.state_dict(), graph.state_dict()
    for key in ("params", "m", "v"):
        assert np.linalg.norm(sa[key] - sb[key]) <= tol * np.linalg.norm(sa[key]), key
    # the all-reduce took part: a plain engine on the same batches (its own gradient, 2/3 of the "mean") ends elsewhere
    plain = engine.build(cfg, "hip", precision=precision, graphs="on", seed=3)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x, y = rng.integers(0, 256, (8, 64)).astype(np.int32), rng.integers(0, 256, (8, 64)).astype(np.int32)
        plain.train_step(x, y, lr=3e-3, weight_decay=0.1, grad_clip=0.0)
    m_plain = plain.state_dict()["m"]   # about 2/3 of the data-parallel run's first moment
    assert np.linalg.norm(1.5 * m_plain - sb["m"]) < 0.1 * np.linalg.norm(sb["m"]) < np.linalg.norm(m_plain - sb["m"])
