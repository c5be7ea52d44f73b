"""AdamW's state in host memory and its update on the CPU (engine.build(..., offload_optimizer=True), train
--offload-optimizer, engine/offload.py).

In the CUDA simulator the offloaded engine trains bit for bit as the GPU update does (the CPU loop is the kernel's
float32 formula), in fp32 and bf16, with the gradients arriving layer by layer from backward's hooks, whole after a
hand-written backward, after gradient accumulation, and across update chunks that split tensors and hold several;
a checkpoint moves between offloaded and resident engines; every combination that cannot work is refused by name;
engine_memory drops the moments from the GPU. On a GPU (`make gpu-test`): the hip engine in bf16, its first update
within a few float32 ulps of the GPU kernel's (a GPU fuses multiply-adds the CPU does not), six steps within 1e-3,
and the pool holds 8 bytes per parameter fewer.
"""

import json

import numpy as np
import pytest

from gpullm_lessons import device, engine
from gpullm_lessons.engine.offload import HostOptimizer, adamw_host
from gpullm_lessons.model.params import GPTConfig, num_params
from test_engine import SMALL, TOY, batch

HP = {"lr": 3e-3, "weight_decay": 0.1, "grad_clip": 0.5}
# Bit for bit holds where the Numba kernel's float32 arithmetic is NumPy's: in the simulator. On a GPU the kernel's
# fused multiply-adds round differently from the CPU loop, and the engine's buffers are CuPy arrays; there
# test_gpu_offloaded_step_matches_the_resident_step_and_frees_the_moments compares within a tolerance instead.
SIMULATOR_BITS = pytest.mark.skipif(
    device.has_gpu(),
    reason="bit-for-bit against the CPU update holds in the simulator only (a GPU fuses multiply-adds)",
)


@pytest.fixture(scope="module")
def batches():
    return [batch(TOY, 2, 8, seed=s) for s in range(2)]


def states_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return {k: np.array_equal(sa[k], sb[k]) for k in ("params", "m", "v")}


@SIMULATOR_BITS
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_engine_trains_bit_for_bit_as_the_gpu_update(precision, batches):
    resident = engine.build(TOY, "numba", precision=precision)
    off = engine.build(TOY, "numba", precision=precision, offload_optimizer=True)
    assert isinstance(off.offload, HostOptimizer) and not off.graphs
    for x, y in batches:
        a, b = resident.train_step(x, y, **HP), off.train_step(x, y, **HP)
        assert a == b
    assert all(states_equal(resident, off).values())
    assert not np.any(off.grads.flat)  # zeroed after the update, as the fused kernels do
    if precision == "bf16":
        assert np.array_equal(resident.half, off.half)  # the half copy rewritten from the new weights


@SIMULATOR_BITS
def test_offload_gradients_arrive_whole_without_hooks_and_after_accumulation(batches):
    """A hand-written step (forward, backward, optimizer_step: no hooks) and two micro-batches (the hooks fire in the
    last one) give the resident engine's result; the hooks of an earlier step do not leak into a later one."""
    resident = engine.build(TOY, "numba")
    off = engine.build(TOY, "numba", offload_optimizer=True)
    (x, y), (x2, y2) = batches
    for eng in (resident, off):
        eng.train_step(x, y, **HP)  # hooks
        eng.forward(x2, y2)
        eng.backward()  # no hooks: the whole buffer is copied in the update
        eng.optimizer_step(HP["lr"], HP["weight_decay"], HP["grad_clip"])
        eng.train_step(x, y, micro_batches=2, **HP)
    assert all(states_equal(resident, off).values())


@SIMULATOR_BITS
def test_offload_chunks_split_tensors_and_hold_several():
    """The update in chunks of 37 elements (tensor boundaries inside chunks, chunk boundaries inside tensors, decay
    and no-decay tensors) equals one chunk over everything and the Numba kernel's own update."""
    from gpullm_lessons.kernels.numba.adamw import adamw_step, decay_table

    eng = engine.build(TOY, "numba", offload_optimizer=True)
    n = num_params(TOY)
    rng = np.random.default_rng(3)
    p0, g0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m0, v0 = rng.standard_normal(n).astype(np.float32), rng.random(n).astype(np.float32)
    results = []
    for chunk in (37, n):
        off = HostOptimizer(eng, chunk=chunk)
        eng.params.flat[...] = p0
        off.pull_master()
        off.m[...], off.v[...] = m0, v0
        eng.grads.flat[...] = g0
        off.step(1e-2, 0.1, 0.5, 3, (0.9, 0.95), 1e-8)
        results.append((off.master.copy(), off.m.copy(), off.v.copy(), eng.params.flat.copy()))
    p, g, m, v = p0.copy(), g0.copy(), m0.copy(), v0.copy()
    adamw_step(p, g, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, 3, decay_bounds=decay_table(eng.params, arrays="numpy"),
               grad_scale=0.5)  # fmt: skip
    bounds, flags = decay_table(eng.params, arrays="numpy")
    assert 0 < flags.sum() < len(flags)  # both kinds of tensor
    for r in results:
        assert all(np.array_equal(a, b) for a, b in zip(r, (p, m, v, p)))


def test_adamw_host_uses_each_tensors_decay_flag():
    """Two tensors, decay on the second only: the first is untouched by the decay term (a table read off by one
    tensor would decay it)."""
    n = 10
    p, g = np.ones(n, np.float32), np.zeros(n, np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    f = np.float32
    adamw_host(p, g, m, v, np.array([0, 4, n]), np.array([0, 1], np.uint8), f(0.1), f(0.5), f(0.9), f(0.1), f(0.95),
               f(0.05), f(0.1), f(0.05), f(1e-8), f(1.0))  # fmt: skip
    assert np.array_equal(p[:4], np.ones(4, np.float32)) and np.all(p[4:] == f(0.5))


@SIMULATOR_BITS
def test_a_checkpoint_moves_between_offloaded_and_resident_engines(batches):
    (x, y), (x2, y2) = batches
    off = engine.build(TOY, "numba", offload_optimizer=True)
    off.train_step(x, y, **HP)
    resident = engine.build(TOY, "numba")
    resident.load_state_dict(off.state_dict())
    back = engine.build(TOY, "numba", offload_optimizer=True)
    back.load_state_dict(resident.state_dict())
    assert np.array_equal(back.offload.master, resident.params.flat)  # the host's master follows a load
    results = [e.train_step(x2, y2, **HP) for e in (off, resident, back)]
    assert results[0] == results[1] == results[2]
    assert all(states_equal(off, resident).values()) and all(states_equal(off, back).values())


def test_offload_refusals_name_the_problem():
    with pytest.raises(engine.EngineError, match="NumPy engine already keeps"):
        engine.build(TOY, "numpy", offload_optimizer=True)
    with pytest.raises(engine.EngineError, match="offload_optimizer keeps AdamW's moments in fp32"):
        engine.build(TOY, "numba", optimizer_state="bf16", offload_optimizer=True)
    eng = engine.build(TOY, "numba", offload_optimizer=True)
    with pytest.raises(engine.EngineError, match="ZeRO shards the optimizer state across GPUs"):
        eng.optimizer_shard(0, 8, eng.params.flat[:8], eng.grads.flat[:8])


def test_engine_memory_without_the_moments_on_the_gpu():
    cfg, n = SMALL, num_params(SMALL)
    a = engine.engine_memory(cfg, 8, 64, "bf16")
    b = engine.engine_memory(cfg, 8, 64, "bf16", offload_optimizer=True)
    assert a["total"] - b["total"] == 8 * n and b["adamw"] == 0 and b["host"] == 16 * n and "host" not in a


@pytest.mark.gpu
def test_gpu_offloaded_step_matches_the_resident_step_and_frees_the_moments():
    import cupy as cp

    from gpullm_lessons.bench.train_step import measure_engine

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128)
    batches = [batch(cfg, 8, 64, seed=s) for s in range(6)]
    resident = engine.build(cfg, "hip", precision="bf16", graphs="off")
    off = engine.build(cfg, "hip", precision="bf16", offload_optimizer=True)
    with pytest.raises(engine.EngineError, match="the optimizer runs on the CPU"):
        engine.build(cfg, "hip", precision="bf16", graphs="on", offload_optimizer=True)
    for i, (x, y) in enumerate(batches):
        a, b = resident.train_step(x, y, **HP), off.train_step(x, y, **HP)
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * a["loss"], (i, a, b)
        if i == 0:  # the same gradients (the same kernels); the update differs only where the GPU fuses a multiply-add
            sa, sb = resident.state_dict(), off.state_dict()
            for key in ("params", "m", "v"):
                assert np.allclose(sa[key], sb[key], rtol=1e-6, atol=0), key
    # later steps: bf16 rounding of the half copy and Adam's early updates (about lr * sign(g)) amplify that; measured
    # on the H200 (2026-12-03): 1.0e-3 of the weights' norm after six steps
    sa, sb = resident.state_dict(), off.state_dict()
    assert np.linalg.norm(sa["params"] - sb["params"]) <= 5e-3 * np.linalg.norm(sa["params"])
    assert not cp.any(off.grads.flat)
    n = num_params(cfg)
    r0 = measure_engine(cfg, 8, 64, "bf16", steps=2)
    r1 = measure_engine(cfg, 8, 64, "bf16", steps=2, offload_optimizer=True)
    assert r0["model_bytes"] - r1["model_bytes"] >= 8 * n


# ---- train.py ---------------------------------------------------------------------------------------------------------
def test_train_offload_flag_trains_as_the_resident_run_and_refuses_what_cannot_work(tmp_path):
    from gpullm_lessons import train

    args = ["--backend", "numba", "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--block-size", "8",
            "--batch-size", "2", "--eval-batches", "1", "--eval-every", "1", "--sample-tokens", "0", "--steps", "1",
            "--no-progress"]  # fmt: skip
    a = train.main(args + ["--out", str(tmp_path / "a")])
    b = train.main(args + ["--offload-optimizer", "--out", str(tmp_path / "b")])
    logs = [[json.loads(r) for r in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("a", "b")]
    assert [r["loss"] for r in logs[0]] == [r["loss"] for r in logs[1]] and a["val_loss"] == b["val_loss"]
    assert b["offload_optimizer"] and not a["offload_optimizer"]
    for extra, match in (
        (["--zero", "1"], "--offload-optimizer with --zero 1"),
        (["--optimizer-state", "bf16"], "--offload-optimizer with --optimizer-state bf16"),
        (["--graphs", "on"], "--graphs on with --offload-optimizer"),
    ):
        with pytest.raises(train.ConfigError, match=match):
            train.main(args + ["--offload-optimizer", "--out", str(tmp_path / "c")] + extra)
    with pytest.raises(train.ConfigError, match="NumPy engine already keeps"):
        train.main(args[2:] + ["--backend", "numpy", "--offload-optimizer", "--out", str(tmp_path / "d")])


# ---- bench memory (lesson 12's table) ----------------------------------------------------------------------------------
def test_bench_memory_measures_each_technique_eager_and_as_a_graph_and_records_refusals(monkeypatch):
    """With a stand-in measure_engine (no GPU): every technique is predicted with its own options and measured
    launched from Python (the peak the prediction describes) and, where it captures, as a graph; an EngineError is
    recorded in its row; the table prints every row."""
    from gpullm_lessons.bench import train_step as bt
    from gpullm_lessons import device

    calls = []

    def fake_measure(cfg, B, T, precision, **kw):
        calls.append(kw)
        if kw["offload_optimizer"] and kw["graphs"] != "off":
            return {"step_ms": 9.0, "peak_bytes": 1, "reserved_bytes": 1, "model_bytes": 1, "cuda_graph": False}
        if kw["optimizer_state"] == "int8":
            raise engine.EngineError("no int8 here")
        graph = kw["graphs"] != "off"
        return {"step_ms": 2.0 if graph else 3.0, "peak_bytes": (5 if graph else 4) * 2**30, "reserved_bytes": 0,
                "model_bytes": 0, "cuda_graph": graph, **({"graph_pool_bytes": 3 * 2**30} if graph else {})}  # fmt: skip

    monkeypatch.setattr(device, "require_gpu", lambda why: None)
    monkeypatch.setattr(bt, "measure_engine", fake_measure)
    monkeypatch.setattr(bt.gc, "collect", lambda: 0)
    import sys
    import types

    fake_cp = types.SimpleNamespace(
        cuda=types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=MemoryError)),
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None),
    )
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(bt, "_card", lambda: "a card")
    result = bt.bench_memory("course", "bf16", steps=2)
    rows = {r["technique"]: r for r in result["rows"]}
    assert list(rows) == [name for name, _ in bt.MEMORY_TECHNIQUES]
    cfg, B = bt._cfg("course")
    for name, opts in bt.MEMORY_TECHNIQUES:
        r = rows[name]
        kw = {"policy": "none", "ce_chunks": 1, "optimizer_state": "fp32", "offload_optimizer": False, **opts}
        gelu_half = kw.pop("gelu_in", "f32") == "half"  # engine versions: the model's half_gelu_in and epilogue
        epi = kw.pop("epilogue", "none") == "cublaslt"
        dgelu = kw.pop("dgelu", "cublaslt")
        logits = kw.pop("logits", "f32")
        dgelu_out = kw.pop("dgelu_out", "f32")
        dqkv_out = kw.pop("dqkv_out", "f32")
        want = engine.engine_memory(
            cfg,
            B,
            cfg.block_size,
            "bf16",
            attention=result["attention"],
            half_gelu_in=gelu_half,
            epilogue=epi,
            dgelu_epilogue=dgelu == "cublaslt",
            half_logits=logits == "half",
            half_dgelu=dgelu_out == "half",
            half_dqkv=dqkv_out == "half",
            **kw,
        )["total"]
        assert r["predicted_bytes"] == want, name
        assert r.get("gelu_in", "f32") == ("half" if gelu_half else "f32"), name
        assert r.get("epilogue", "none") == ("cublaslt" if epi else "none"), name
        assert r.get("dgelu", "cublaslt") == dgelu, name
        assert r.get("logits", "f32") == logits, name
        assert r.get("dgelu_out", "f32") == dgelu_out, name
        assert r.get("dqkv_out", "f32") == dqkv_out, name
        if kw["optimizer_state"] == "int8":
            assert r["error"] == "no int8 here"
        elif kw["offload_optimizer"]:
            assert r["peak_bytes"] == 4 * 2**30 and "graph_step_ms" not in r  # eager only
        else:
            assert (r["peak_bytes"], r["step_ms"], r["graph_step_ms"]) == (4 * 2**30, 3.0, 2.0), name
            assert r["graph_pool_bytes"] == 3 * 2**30 == bt.graph_pool_of(r, "graph_peak_bytes"), name
    assert {c["graphs"] for c in calls} == {"off", "auto"}
    half_calls = [c for c in calls if (c.get("versions") or {}).get("gelu_in") == "half"]
    assert len(half_calls) == 2 * sum(opts.get("gelu_in") == "half" for _, opts in bt.MEMORY_TECHNIQUES)
    epi_calls = [c for c in calls if (c.get("versions") or {}).get("epilogue") == "cublaslt"]
    assert len(epi_calls) == 2 * sum(opts.get("epilogue") == "cublaslt" for _, opts in bt.MEMORY_TECHNIQUES) > 0
    kernel_calls = [c for c in calls if (c.get("versions") or {}).get("dgelu") == "kernel"]
    assert len(kernel_calls) == 2 * sum(opts.get("dgelu") == "kernel" for _, opts in bt.MEMORY_TECHNIQUES) > 0
    half_logit_calls = [c for c in calls if (c.get("versions") or {}).get("logits") == "half"]
    assert len(half_logit_calls) == 2 * sum(opts.get("logits") == "half" for _, opts in bt.MEMORY_TECHNIQUES) > 0
    text = bt.format_memory(result)
    assert all(name in text for name in rows) and "no int8 here" in text
    # fp32: the epilogue technique is refused in its row (half precision only), the others are measured
    f32 = {r["technique"]: r for r in bt.bench_memory("course", "fp32", steps=2)["rows"]}
    epi_rows = [name for name, opts in bt.MEMORY_TECHNIQUES if "epilogue" in opts]
    assert all("half-precision" in f32[name]["error"] for name in epi_rows)
    assert "error" not in f32["plain"]


# ---- bench train's engine options (lesson 14) ------------------------------------------------------------------------
def test_bench_train_hands_ce_chunks_and_versions_to_every_engine_row_and_records_them(monkeypatch):
    """With stand-ins for the GPU parts: both engine rows (from Python, as a graph) get ce_chunks and versions, the
    result records them, and the command line reaches bench_train with --ce-chunks and --gelu-in."""
    from gpullm_lessons import device
    from gpullm_lessons.bench import kernels as bench
    from gpullm_lessons.bench import timing
    from gpullm_lessons.bench import train_step as bt

    calls = []

    def fake_measure(cfg, B, T, precision, **kw):
        calls.append(kw)
        return {"step_ms": 2.0, "peak_bytes": 1, "status": "ok"}

    monkeypatch.setattr(device, "require_gpu", lambda why: None)
    monkeypatch.setattr(bt, "measure_engine", fake_measure)
    monkeypatch.setattr(bt, "first_step_reference", lambda cfg, x, y: None)
    monkeypatch.setattr(bt, "_card", lambda: "a card")
    monkeypatch.setattr(timing, "matmul_rate", lambda dtype: {"TFLOP/s": 100.0})
    result = bt.bench_train(("course",), ("bf16",), with_torch=False, versions={"gelu_in": "half"}, ce_chunks=8)
    assert len(calls) == 2 and calls[0].get("graphs", "off") == "off" and calls[1]["graphs"] == "on"
    assert all(c["ce_chunks"] == 8 and c["versions"] == {"gelu_in": "half"} for c in calls)
    assert result["ce_chunks"] == 8 and result["versions"] == {"gelu_in": "half"}
    assert "ce_chunks" not in bt.bench_train(("course",), ("bf16",), with_torch=False)  # the default is not written

    seen = {}
    monkeypatch.setattr(bt, "bench_train", lambda *a, **kw: seen.update(kw) or {"rows": []})
    monkeypatch.setattr(bt, "format_train", lambda r: "")
    assert (
        bench.main(["train", "--presets", "course", "--precisions", "bf16", "--ce-chunks", "8", "--gelu-in", "half"])
        == 0
    )
    assert seen["ce_chunks"] == 8 and seen["versions"] == {"gelu_in": "half"}
    assert bench.main(["train", "--presets", "course", "--precisions", "bf16", "--epilogue", "cublaslt"]) == 0
    assert seen["versions"] == {"epilogue": "cublaslt"}
    argv = ["train", "--presets", "course", "--precisions", "bf16", "--epilogue", "cublaslt", "--dgelu", "kernel"]
    assert bench.main(argv) == 0
    assert seen["versions"] == {"epilogue": "cublaslt", "dgelu": "kernel"}
    # the profiles of the step take the same options: gputime and timeline
    from gpullm_lessons.bench import profiling

    for what, fn, fmt, mod in (
        ("gputime", "gpu_time_profile", "format_gpu_time", bt),
        ("timeline", "step_timeline", "format_timeline", profiling),
    ):
        got = {}
        monkeypatch.setattr(bt, fn, lambda *a, got=got, **kw: got.update(kw) or {"rows": []})
        monkeypatch.setattr(mod, fmt, lambda r: "")
        argv = [what, "--presets", "gpt2", "--epilogue", "cublaslt", "--gelu-in", "half", "--ce-chunks", "8"]
        assert bench.main(argv) == 0, what
        assert got["ce_chunks"] == 8 and got["versions"] == {"epilogue": "cublaslt", "gelu_in": "half"}, what
        assert bench.main(argv + ["--dgelu", "kernel"]) == 0, what
        assert got["versions"] == {"epilogue": "cublaslt", "gelu_in": "half", "dgelu": "kernel"}, what
        assert bench.main(argv + ["--logits", "half"]) == 0, what
        assert got["versions"] == {"epilogue": "cublaslt", "gelu_in": "half", "logits": "half"}, what
        assert bench.main(argv + ["--dgelu-out", "half"]) == 0, what
        assert got["versions"] == {"epilogue": "cublaslt", "gelu_in": "half", "dgelu_out": "half"}, what
        assert bench.main(argv + ["--dqkv-out", "half"]) == 0, what
        assert got["versions"] == {"epilogue": "cublaslt", "gelu_in": "half", "dqkv_out": "half"}, what


def test_graph_pool_of_reads_the_pool_or_derives_it_for_runs_that_held_the_copy_on_the_gpu():
    """Rows that report the graph's pool give it back; rows stored before StepGraph kept its capture-time copy on
    the host (no graph_pool_bytes) held the model twice beside the pool."""
    from gpullm_lessons.bench import train_step as bt

    assert bt.graph_pool_of({"peak_bytes": 10, "model_bytes": 3, "graph_pool_bytes": 7}) == 7
    assert bt.graph_pool_of({"peak_bytes": 10, "model_bytes": 3}) == 4
    assert bt.graph_pool_of({"graph_peak_bytes": 12, "model_bytes": 3}, "graph_peak_bytes") == 6
