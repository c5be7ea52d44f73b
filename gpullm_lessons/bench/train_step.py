"""Benchmarks of the whole training step on a GPU: our engine beside PyTorch, and the checkpointing trade-off.

    python -m gpullm_lessons.bench train [--presets course,gpt2] [--precisions fp32,bf16] [--json PATH]
    python -m gpullm_lessons.bench checkpointing [--presets course,gpt2] [--json PATH] [--plot PATH]
    python -m gpullm_lessons.bench long [--presets gpt2] [--seq-len 4096] [--batch-size 32] [--json PATH]
    python -m gpullm_lessons.bench fits [--json PATH]

`train`: for each preset and precision, the median time of a full training step (forward, backward, global-norm
clip, AdamW) after warm-up, tokens/s, model FLOPs per step (every matrix product, x3 for forward + backward,
attention counted without the causal half), achieved TFLOP/s and MFU against the matmul rate measured in the same
run in that precision, and the peak memory of CuPy's memory pool. With torch installed the same architecture in
PyTorch (eager, scaled_dot_product_attention, fused AdamW, bf16 autocast for bf16) is timed on the same shapes.

`long`: one long-context batch on each attention path (bench_long): the scores path beside flash attention, the
prediction of engine_memory beside the measured peak, or the out-of-memory error where the step does not fit.

`fits`: the edge of the "what fits" table (what_fits, from engine_memory) confirmed on this GPU: the most layers the
model allows for a 1024-wide GPT at T = 4096, B = 8, bf16, flash attention, no checkpointing, run; one layer more,
tried.

`checkpointing`: per preset and policy (none / selective / full / sqrt), the step time and the measured peak memory
beside the predictions of engine.engine_memory (the engine's tensors) and checkpointing.memory_model (the
reference's cache). Peak = the largest number of bytes in use in CuPy's memory pool at any allocation (an
allocator hook reads pool.used_bytes() after each malloc); "reserved" = what the pool holds at the end, which adds
the fragmentation of its free blocks.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import re
import sys
import time

import numpy as np

from .. import device
from .timing import validate_then_time, wrong_message

SHAPES = {"course": 64, "gpt2": 16}        # batch size per preset (T = the preset's block size)


def _cfg(preset):
    from ..model.params import preset_config

    return preset_config(preset)


def step_flops(cfg, B, T) -> float:
    """Model FLOPs of one training step: 3 x (2 x multiply-adds of every matrix product in the forward)."""
    C, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    per_token = 2 * L * (C * 3 * C + C * C + C * 4 * C + 4 * C * C) + 2 * C * V + 2 * L * 2 * T * C
    return 3.0 * per_token * B * T


def _batches(cfg, B, T, n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
             rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)) for _ in range(n)]


def _time_steps(step, batches, warmup=3):
    """Median seconds of step(x, y) over the batches after `warmup` steps (each step synchronised)."""
    import cupy as cp

    for x, y in batches[:warmup]:
        step(x, y)
    cp.cuda.Device().synchronize()
    times = []
    for x, y in batches[warmup:]:
        t0 = time.perf_counter()
        step(x, y)
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# Validate, then time (timing.validate_then_time): before a configuration of our engine is timed, its first step's
# loss and gradient norm are compared with the NumPy engine's first step on the same weights (engine.build's seed 0)
# and batch. Tolerances: relative error, from tests/test_engine.py (fp32: 1e-4, test_train_steps_match_the_numpy_engine
# and test_gpu_fp32_first_10_steps_match_the_reference; bf16 / fp16: 2e-2, test_gpu_half_precision_tracks_fp32).
# "tf32": an fp32 run whose matmul inputs are read as TF32 (10 mantissa bits: bf16's tolerance bounds it)
TRAIN_TOL = {"fp32": 1e-4, "tf32": 2e-2, "bf16": 2e-2, "fp16": 2e-2}
ENGINE_PRECISION = {"tf32": ("fp32", {"tf32": "on"})}  # a bench precision that is an engine precision + versions
TORCH_WHY_NOT = ("PyTorch's GPT starts from its own random weights (torch.manual_seed(0)), not the engine's: its "
                 "loss is not the reference's")


REFERENCE_CACHE_ENV = "GPULLM_REFERENCE_CACHE"   # a directory: first_step_reference keeps its results there


def _reference_key(cfg, x, y) -> str:
    """What first_step_reference's result depends on: the model's shape, the batch, and the source of the NumPy
    engine and everything it computes with (model/, reference/, engine/), so that a changed line is a new key."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256(repr(sorted(vars(cfg).items())).encode())
    for a in (x, y):
        h.update(str(a.shape).encode() + np.ascontiguousarray(a).tobytes())
    root = Path(__file__).resolve().parents[1]
    for sub in ("model", "reference", "engine"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:32]


def first_step_reference(cfg, x, y) -> dict:
    """The NumPy engine's first training step on batch (x, y), from the weights every engine starts from (seed 0):
    {"loss", "grad_norm"} (the gradient norm is taken before the update, so lr and clipping do not change it). On
    a CPU, at GPT-2's size and a batch of 16 x 1024 tokens, this takes about a minute. With GPULLM_REFERENCE_CACHE
    set to a directory, a result is kept there under _reference_key and read back by the next run (one sitting on a
    lent GPU runs bench train several times over the same batches)."""
    import json
    import os
    from pathlib import Path

    from .. import engine

    where = os.environ.get(REFERENCE_CACHE_ENV)
    path = Path(where) / f"first_step_{_reference_key(cfg, x, y)}.json" if where else None
    if path is not None and path.is_file():
        return json.loads(path.read_text())
    r = engine.build(cfg, "numpy").train_step(x, y, lr=1e-4, weight_decay=0.1, grad_clip=1.0)
    result = {"loss": float(r["loss"]), "grad_norm": float(r["grad_norm"])}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    return result


def validated_steps(step, batches, reference, tol, time_steps=None) -> dict:
    """Validate, then time, a training step: step(x, y) on batches[0] (untimed) must give the reference's loss and
    gradient norm within tol (timing.max_error: relative error); only then are the other batches timed,
    time_steps(step, batches[1:]) -> seconds (default _time_steps, 2 warm-up steps). Returns {"status",
    "validation", "sec"} or, for a wrong step, {"status": "wrong", "validation", "error"} without a time. A step
    that was skipped (fp16: the loss scale backed off on an overflow) has no gradient norm: its loss alone is
    compared."""
    want, first = dict(reference), {}

    def run():
        first.update(step(*batches[0]))
        if first.get("skipped"):
            want.pop("grad_norm", None)

    def timer(_run):
        return {"sec": (time_steps or (lambda st, bs: _time_steps(st, bs, warmup=2)))(step, batches[1:])}

    return validate_then_time(run, lambda _: {k: first[k] for k in want}, want, tol, timer)


class PeakTracker:
    """Where a pool's live peak was reached: the step's phase (the innermost engine.profiler.nvtx_range: "forward",
    "backward", "optimizer", ...; "outside the step" between them), the size of the allocation that set it and the
    innermost function of the course's engine or launchers that asked for it ("site": "name (file:line)").
    measure_engine reports it as "peak_at", so a peak the memory model did not predict names its phase."""

    def __init__(self):
        self.high, self.at, self._phases = 0, None, []

    @contextlib.contextmanager
    def phase(self, name):  # engine.profiler.range_hook's hook
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    def note(self, used_bytes, size):
        """After an allocation of `size` bytes the pool holds `used_bytes` in use: a new peak records where."""
        if used_bytes > self.high:
            self.high = int(used_bytes)
            self.at = {"phase": self._phases[-1] if self._phases else "outside the step", "bytes": int(size),
                       "site": _course_site(sys._getframe(1))}


def _course_site(frame) -> str:
    """The innermost caller in the course's engine, backends or kernels (not this module): "name (file:line)"."""
    here = __file__
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if path != here and any(part in path for part in ("gpullm_lessons/engine/", "gpullm_lessons/backends/",
                                                          "gpullm_lessons/runtime/", "/kernels/")):
            return f"{frame.f_code.co_name} ({path.rsplit('/', 1)[-1]}:{frame.f_lineno})"
        frame = frame.f_back
    return "elsewhere"


def measure_engine(cfg, B, T, precision="fp32", policy="none", backend="hip", steps=10, versions=None,
                   graphs="off", ce_chunks=1, optimizer_state="fp32", offload_optimizer=False, reference=None) -> dict:
    """Step time and CuPy-pool peak bytes of our engine on random tokens (ce_chunks, optimizer_state,
    offload_optimizer: the engine's options of lesson 12; pinned host memory is not in the pool).

    graphs="off": every step launched from Python (the peak is the live peak of CuPy's pool, read at every malloc);
    "auto" / "on": the step replayed as a CUDA graph (engine.StepGraph); its activations live in the graph's private
    pool, so the peak is the default pool's peak (the model and optimizer state, model_bytes: StepGraph keeps its copy
    of them during the capture in host memory) + the private pool's size ("graph_pool_bytes").

    reference: first_step_reference of the first batch: the first step is then validated before anything is timed
    (validated_steps, TRAIN_TOL[precision]) and the result carries "status" and "validation"; a wrong step has no
    step_ms."""
    import cupy as cp

    from .. import engine

    from ..engine.profiler import range_hook

    pool = cp.get_default_memory_pool()
    gc.collect()                                     # an earlier engine (and its graphs) must be gone: its arrays
    pool.free_all_blocks()                           # would count in this one's bytes
    peak = PeakTracker()

    def tracking_malloc(size):                       # every allocation goes through the pool; note the live peak
        mem = pool.malloc(size)
        peak.note(pool.used_bytes(), size)
        return mem

    cp.cuda.set_allocator(tracking_malloc)
    phases = range_hook(peak.phase)
    phases.__enter__()
    engine_precision, more = ENGINE_PRECISION.get(precision, (precision, {}))
    versions = {**(versions or {}), **more} or None
    try:
        eng = engine.build(cfg, backend, precision=engine_precision, policy=policy, versions=versions, graphs=graphs,
                           ce_chunks=ce_chunks, optimizer_state=optimizer_state, offload_optimizer=offload_optimizer)
        model_bytes = pool.used_bytes()              # params, grads, m, v (+ the half copy): before any step
        batches = _batches(cfg, B, T, steps + 3)
        step = lambda x, y: eng.train_step(x, y, lr=1e-4, weight_decay=0.1, grad_clip=1.0)  # noqa: E731
        if reference is None:
            checked = {"sec": _time_steps(step, batches)}
        else:
            checked = validated_steps(step, batches, reference, TRAIN_TOL[precision])
        reserved = pool.total_bytes()                # what the pool holds: the live peak plus fragmentation
        graph_bytes = eng.graph_pool_bytes() if eng.graphs else 0
        high = peak.high + graph_bytes
        reserved += graph_bytes
        graphed = bool(eng.graphs)
        eng = None                                   # the engine's buffers back to the pool (step still names it)
    finally:
        cp.cuda.set_allocator(pool.malloc)
        phases.__exit__(None, None, None)
    gc.collect()
    pool.free_all_blocks()
    sec = checked.pop("sec", None)
    return {**({"step_ms": 1e3 * sec} if sec is not None else {}), "peak_bytes": int(high), "peak_at": peak.at,
            "reserved_bytes": int(reserved), "model_bytes": int(model_bytes), "cuda_graph": graphed,
            **({"graph_pool_bytes": int(graph_bytes)} if graphed else {}), **checked}


def graph_pool_of(row, peak_key="peak_bytes") -> int:
    """The graph's private pool in a stored graph run's row (measure_engine's, or bench memory's with peak_key
    "graph_peak_bytes"): as the run reported it, or, for runs from before StepGraph kept its capture-time copy of the
    model and optimizer state on the host (they report no pool), the peak less that copy and the model itself."""
    if "graph_pool_bytes" in row:
        return int(row["graph_pool_bytes"])
    return int(row[peak_key] - 2 * row["model_bytes"])


def measure_torch(cfg, B, T, precision="fp32", steps=10, compile=False) -> dict:
    """The same GPT in PyTorch eager: SDPA causal attention, fused AdamW, bf16 autocast for bf16. compile=True: the
    model through torch.compile (the default inductor backend; the optimizer step stays eager and fused), its
    compilation done in the warm-up steps, outside the timed ones."""
    import torch

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    # "tf32": fp32 with TF32 matmuls (PyTorch's allow_tf32 flags, off by default for matmuls), like the engine's
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        step, release = _torch_step(cfg, precision, compile)
        batches = _batches(cfg, B, T, steps + 3)
        for x, y in batches[:3]:
            step(x, y)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for x, y in batches[3:]:
            t0 = time.perf_counter()
            step(x, y)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated()
        release()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return {"step_ms": 1e3 * float(np.median(times)), "peak_bytes": int(peak), "version": torch.__version__}


def torch_gpt(cfg, device="cuda"):
    """The course's GPT in PyTorch (measure_torch's and torch_compile_anatomy's): nn.Linear / nn.LayerNorm blocks,
    SDPA causal attention, tanh GELU, the tied head; forward(idx, targets) returns the mean cross-entropy. Seeded."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    C, nh = cfg.d_model, cfg.n_head

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            Bb, Tt, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(Bb, Tt, nh, C // nh).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(Bb, Tt, C)
            x = x + self.proj(y)
            return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab_size, C), nn.Embedding(cfg.block_size, C)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.lnf = nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = F.linear(self.lnf(x), self.wte.weight)           # tied head
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    torch.manual_seed(0)
    return GPT().to(device)


def _torch_step(cfg, precision, compile=False):
    """(step(x, y), release()): one training step of the PyTorch GPT (measure_torch's), and a call that frees its
    model and optimizer."""
    import torch

    model = torch_gpt(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if compile:
        model = torch.compile(model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    held = {"model": model, "opt": opt}

    def step(x, y):
        x, y = torch.from_numpy(x).long().cuda(), torch.from_numpy(y).long().cuda()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = held["model"](x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(held["model"].parameters(), 1.0)
        held["opt"].step()
        held["opt"].zero_grad(set_to_none=True)

    def release():                                   # free PyTorch's model and optimizer before empty_cache
        held.clear()
        torch.cuda.empty_cache()

    return step, release


def torch_gpu_time(cfg, B, T, precision="bf16", steps=3, compile=False) -> dict:
    """GPU time per step of the PyTorch GPT's kernels, kernel by kernel (torch.profiler's CUDA activity, summed over
    `steps` profiled steps after 3 warm-up steps, divided by steps): {"version", "total_ms", "kernels": {name: ms}}.
    compile: the model through torch.compile (compiled in the warm-up steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step, release = _torch_step(cfg, precision, compile)
    batches = _batches(cfg, B, T, steps + 3)
    for x, y in batches[:3]:
        step(x, y)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for x, y in batches[3:]:
            step(x, y)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us:
            kernels[e.key] = kernels.get(e.key, 0.0) + us / 1e3 / steps
    release()
    return {"version": torch.__version__, "total_ms": sum(kernels.values()), "kernels": kernels}


# the groups a step's GPU time is compared in, ours beside PyTorch's: (group, regular expression on the op or kernel
# name, case-insensitive); the first group that matches takes a name, the others go to "other". PyTorch's names as
# torch.profiler reports them on an H200 (2.11): cuBLAS's nvjet / xmma kernels (bias epilogues among them), cuDNN's
# SDPA kernels and their cudnn::fusion helpers, the bias gradients as sum reductions, the residual adds as add functors;
# its dtype casts and copies stay in "other" (the fused kernels of this course do them inside other ops)
GPU_TIME_GROUPS = (
    ("matrix products", r"gemm|cutlass|xmma|nvjet|cublas|splitk"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn::fusion|split_heads|merge_heads"),
    ("layernorm", r"layer_?norm|gammabeta"),
    ("loss head", r"crossentropy|cross_entropy|softmax|nll"),
    ("optimizer", r"adam|grad_sumsq|multi_tensor|foreach"),
    ("gelu, bias, residual", r"gelu|bias|colsum|sum_functor|functor_add"),
    ("embedding", r"encoder|embedding"),
)


def gpu_time_group(name: str) -> str:
    """The GPU_TIME_GROUPS group of an op (ours) or a kernel name (PyTorch's); "other" when none matches."""
    for group, pattern in GPU_TIME_GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def ops_in_group(result, group) -> dict:
    """{our op: ms per step} of the gpu_time_profile result's ops in `group` (its distinct calls summed per op),
    largest first."""
    ms = {}
    for r in result["rows"]:
        if gpu_time_group(r["op"]) == group:
            ms[r["op"]] = ms.get(r["op"], 0.0) + (r["ms"] or 0.0)
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


def format_gpu_time_change(old, new, labels=("before", "now")) -> str:
    """Two gpu_time_profile results of the same step side by side (with_torch): per result our total and PyTorch's,
    and our attention op by op; then each group's ms in both, beside PyTorch's (new's run)."""
    from . import stored

    lines = []
    for label, prof in zip(labels, (old, new)):
        att = ops_in_group(prof, "attention")
        lines.append(f"{label} ({stored.describe(prof)}): our kernels {prof['total_ms']:.1f} ms per step, PyTorch's "
                     f"{prof['torch']['total_ms']:.1f}; attention {sum(att.values()):.2f} ms: "
                     + ", ".join(f"{op} {ms:.2f}" for op, ms in att.items()))
    lines += ["", f"{'group':<24}{labels[0]:>8}{labels[1]:>8}{'PyTorch':>9}"]
    before = {g: ours for g, ours, _ in grouped_gpu_time(old)}
    now = {g: (ours, theirs or 0.0) for g, ours, theirs in grouped_gpu_time(new)}
    for group in list(now) + [g for g in before if g not in now]:  # a group only the old step had: 0 now
        ours, theirs = now.get(group, (0.0, 0.0))
        lines.append(f"{group:<24}{before.get(group, 0.0):8.2f}{ours:8.2f}{theirs:9.2f}")
    return "\n".join(lines)


def grouped_gpu_time(result) -> list:
    """[(group, our ms, PyTorch's ms or None)] of a gpu_time_profile result, in GPU_TIME_GROUPS order, "other" last."""
    ours, theirs = {}, {}
    for r in result["rows"]:
        g = gpu_time_group(r["op"])
        ours[g] = ours.get(g, 0.0) + (r["ms"] or 0.0)
    torch_side = result.get("torch")
    for name, ms in (torch_side or {}).get("kernels", {}).items():
        g = gpu_time_group(name)
        theirs[g] = theirs.get(g, 0.0) + ms
    groups = [g for g, _ in GPU_TIME_GROUPS] + ["other"]
    return [(g, ours.get(g, 0.0), theirs.get(g, 0.0) if torch_side else None) for g in groups
            if g in ours or g in theirs]


def _card():
    import cupy as cp

    return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()


def bench_train(presets=("course", "gpt2"), precisions=("fp32", "tf32", "bf16"), steps=10, backend="hip",
                with_torch=True, versions=None, with_compile=False, on_config=None, ce_chunks=1,
                variants=None) -> dict:
    """Step time, tokens/s, MFU and peak memory of our engine (launched from Python, and replayed as a CUDA graph)
    beside the same model in PyTorch eager and, with_compile, through torch.compile: every ratio from one run.

    Validate, then time: each configuration of our engine first runs one step whose loss and gradient norm are
    compared with the NumPy engine's first step (first_step_reference, once per preset) within TRAIN_TOL; a wrong
    one is a row with status "wrong", its validation and no time. PyTorch's rows are timed unvalidated
    (validation.why_not: TORCH_WHY_NOT).

    on_config(result): called after each (preset, precision) with the result so far, marked "partial": True (a run cut
    short keeps what it finished); each configuration's seconds and the NumPy reference's go to stderr.
    ce_chunks: our engine's loss head in that many chunks of rows (lesson 12; 1: the whole batch at once).

    variants: [(label, {version: value, ..., optionally "ce_chunks": n})]: our engine measured once per variant (its
    versions over `versions`, its ce_chunks over `ce_chunks`) beside one PyTorch measurement per configuration, so
    that a run compares several of our versions with the same PyTorch rows. Each of our rows then carries "variant"
    (its label) and the result a "variants" table {label: (versions, ce_chunks)}. See parse_variant."""
    device.require_gpu("benchmarking the training step")
    from ..engine import EngineError
    from .timing import matmul_rate

    rates = {p: matmul_rate(dtype={"fp32": "float32", "tf32": "tf32", "bf16": "bfloat16", "fp16": "float16"}[p])
             for p in precisions}
    try:
        import torch  # noqa: F401
    except ImportError:
        with_torch = False
    rows = []
    runs_of = [(None, dict(versions or {}), ce_chunks)]
    if variants:
        runs_of = []
        for label, v in variants:
            v = dict(v)
            chunks = v.pop("ce_chunks", ce_chunks)
            runs_of.append((label, {**(versions or {}), **v}, chunks))

    def result():
        return {"card": _card(), "date": datetime.date.today().isoformat(), "matmul_rates": rates, "rows": rows,
                "versions": dict(versions or {}),  # the engine's versions asked for beyond its defaults
                "blaslt_tune": _blaslt_tuning(),  # cuBLASLt's candidates timed on first calls (runtime/blaslt.py)
                **({"ce_chunks": ce_chunks} if ce_chunks != 1 else {}),
                **({"variants": {label: {"versions": v, "ce_chunks": c} for label, v, c in runs_of}}
                   if variants else {})}

    for preset in presets:
        cfg, B = _cfg(preset)
        T = cfg.block_size
        flops = step_flops(cfg, B, T)
        started = time.perf_counter()
        reference = first_step_reference(cfg, *_batches(cfg, B, T, 1)[0])   # measure_engine's first batch
        print(f"bench train: {preset}: the NumPy engine's first step, {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
        for prec in precisions:
            started = time.perf_counter()
            runs = []
            for label, v, chunks in runs_of:
                tag = {} if label is None else {"variant": label}
                try:
                    r = measure_engine(cfg, B, T, prec, backend=backend, steps=steps, versions=v or None,
                                       reference=reference, ce_chunks=chunks)
                except EngineError as e:
                    if label is None:
                        raise
                    runs.append(("ours", backend, {**tag, "status": "error", "error": f"{type(e).__name__}: {e}",
                                                   "validation": {"ok": None, "why_not": "not run: the engine "
                                                                  "refused this variant (error)"}}))
                    continue  # this variant cannot run here; the others go on
                runs.append(("ours", backend, {**tag, **r}))
                try:
                    runs.append(("ours+graph", backend, {**tag, **measure_engine(
                        cfg, B, T, prec, backend=backend, steps=steps, versions=v or None, graphs="on",
                        reference=reference, ce_chunks=chunks)}))
                except EngineError as e:  # a step that cannot be captured (fp16: the loss scaler decides on the host)
                    print(f"{preset} {prec}: no CUDA-graph row ({e})", file=sys.stderr)
            if with_torch:
                unvalidated = {"status": "unvalidated", "validation": {"ok": None, "why_not": TORCH_WHY_NOT}}
                r = measure_torch(cfg, B, T, prec, steps=steps)
                runs.append(("pytorch", r.pop("version"), {**r, **unvalidated}))
                if with_compile:
                    r = measure_torch(cfg, B, T, prec, steps=steps, compile=True)
                    runs.append(("torch.compile", r.pop("version"), {**r, **unvalidated}))
            for who, version, r in runs:
                row = {"preset": preset, "B": B, "T": T, "precision": prec, "who": who, "version": version, **r}
                if "step_ms" in r:
                    tflops = flops / (r["step_ms"] / 1e3) / 1e12
                    row.update({"tokens_per_s": B * T / (r["step_ms"] / 1e3), "TFLOP/s": tflops,
                                "MFU": tflops / rates[prec]["TFLOP/s"]})
                rows.append(row)
            print(f"bench train: {preset} {prec}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            if on_config is not None:
                on_config({**result(), "partial": True})
    return result()


def format_train(result) -> str:
    """The step table of bench_train; a configuration whose first step did not match the NumPy engine's shows
    "wrong (max err X > tol Y at loss)" and no time."""
    w = max([14] + [len(r["who"]) + len(r["variant"]) + 4 for r in result["rows"] if "variant" in r])
    lines = [f"training step on {result['card']} ({result['date']})",
             "MFU against the measured matmul rate: "
             + ", ".join(f"{p} {r['TFLOP/s']:.0f} TFLOP/s" for p, r in result["matmul_rates"].items()),
             f"{'preset':<8}{'B':>4}{'T':>6} {'prec':<6}{'who':<{w}}{'ms/step':>9}{'tokens/s':>11}{'TFLOP/s':>9}"
             f"{'MFU':>7}{'peak GiB':>10}"]
    for r in result["rows"]:
        who = r["who"] + (f" [{r['variant']}]" if "variant" in r else "")
        head = f"{r['preset']:<8}{r['B']:>4}{r['T']:>6} {r['precision']:<6}{who:<{w}}"
        if "step_ms" not in r:
            lines.append(f"{head}{wrong_message(r['validation']) if r.get('status') == 'wrong' else r.get('error')}")
            continue
        lines.append(f"{head}{r['step_ms']:9.2f}"
                     f"{r['tokens_per_s']:11,.0f}{r['TFLOP/s']:9.1f}{100 * r['MFU']:6.1f}%"
                     f"{r['peak_bytes'] / 2**30:10.2f}")
    for label, v in (result.get("variants") or {}).items():
        shown = ", ".join(f"{k} {val}" for k, val in v["versions"].items()) or "the engine's defaults"
        lines.append(f"[{label}]: {shown}, ce_chunks {v['ce_chunks']}")
    checked = [r for r in result["rows"] if (r.get("validation") or {}).get("ok")]
    if checked:
        lines.append(f"validated: each of our rows' first step against the NumPy engine's (loss, gradient norm); "
                     f"largest error {max(r['validation']['max_err'] for r in checked):.1e}")
    return "\n".join(lines)


def bench_long(preset="gpt2", T=4096, B=32, precision="bf16", steps=3, with_torch=True) -> dict:
    """The memory side of flash attention: one long-context batch (B, T) of a preset's model (its block size raised
    to T), on each attention path, predicted by engine_memory and then run. A path whose step does not fit the GPU is
    tried all the same: its row records the out-of-memory error beside the prediction (the honest way to show that
    the scores path cannot hold (B, nh, T, T) per layer). PyTorch (SDPA) on the same batch beside it."""
    import dataclasses

    device.require_gpu("benchmarking a long-context step")
    import cupy as cp

    from ..engine import engine_memory

    cfg = dataclasses.replace(_cfg(preset)[0], block_size=T)
    free, total = cp.cuda.runtime.memGetInfo()
    rows = []
    for attention in ("cublas", "flash"):
        pred = engine_memory(cfg, B, T, precision, attention=attention)["total"]
        row = {"who": "ours", "attention": attention, "predicted_bytes": int(pred)}
        rows.append(_measured_or_out_of_memory(row, cfg, B, T, precision, steps=steps,
                                               versions={"attention": attention}))
    if with_torch:
        try:
            import torch  # noqa: F401

            r = measure_torch(cfg, B, T, precision, steps=steps)
            rows.append({"who": "pytorch", "attention": "sdpa", "version": r.pop("version"), **r})
        except ImportError:
            pass
    return {"card": _card(), "date": datetime.date.today().isoformat(), "preset": preset, "B": B, "T": T,
            "precision": precision, "gpu_bytes": int(total), "free_bytes_at_start": int(free), "rows": rows}


def format_long(result) -> str:
    lines = [f"{result['preset']} B{result['B']} T{result['T']} {result['precision']} on {result['card']} "
             f"({result['date']}), {result['gpu_bytes'] / 2**30:.1f} GiB",
             f"{'who':<9}{'attention':<11}{'predicted GiB':>14}{'peak GiB':>10}{'ms/step':>9}{'tokens/s':>11}"]
    for r in result["rows"]:
        pred = f"{r['predicted_bytes'] / 2**30:14.1f}" if "predicted_bytes" in r else f"{'':>14}"
        if "error" in r:
            lines.append(f"{r['who']:<9}{r['attention']:<11}{pred}  {r['error']}")
            continue
        tps = result["B"] * result["T"] / (r["step_ms"] / 1e3)
        lines.append(f"{r['who']:<9}{r['attention']:<11}{pred}{r['peak_bytes'] / 2**30:10.1f}{r['step_ms']:9.1f}"
                     f"{tps:11.0f}")
    return "\n".join(lines)


def largest_layers(C, T, B, budget_bytes, precision="bf16", policy="none", attention="flash", vocab=50257,
                   max_layers=4096):
    """The most layers a GPT of width C (heads of 64) at context T and batch B can have while engine_memory's
    predicted step peak stays within budget_bytes (0 when not even one layer fits); with its prediction."""
    def total(L):
        return _predict(_wide_gpt(C, T, L, vocab), B, T, precision, policy, attention)

    if C % 64:
        raise ValueError(f"largest_layers: width C = {C} is not a multiple of the head size 64")
    if total(1) > budget_bytes:
        return 0, total(1)
    lo, hi = 1, max_layers
    if total(hi) <= budget_bytes:
        return hi, total(hi)
    while hi - lo > 1:  # total(lo) fits, total(hi) does not: the peak grows with L
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= budget_bytes else (lo, mid)
    return lo, total(lo)


def what_fits(budget_bytes, widths=(768, 1024, 1600, 2048), contexts=(1024, 4096), B=8, precision="bf16",
              combos=(("cublas", "none"), ("flash", "none"), ("flash", "selective"), ("flash", "full"))) -> list:
    """The "what fits" table: for each width, context and (attention, checkpointing) combination, the most layers
    whose predicted step peak (engine_memory) fits in budget_bytes. Rows of dicts."""
    rows = []
    for C in widths:
        for T in contexts:
            for attention, policy in combos:
                L, need = largest_layers(C, T, B, budget_bytes, precision, policy, attention)
                rows.append({"C": C, "T": T, "B": B, "attention": attention, "policy": policy, "layers": L,
                             "predicted_bytes": int(need)})
    return rows


def bench_fits(C=1024, T=4096, B=8, precision="bf16", policy="none", attention="flash", steps=3) -> dict:
    """Confirm the "what fits" table at its edge on this GPU: the most layers the model allows for (C, T, B) in the
    memory CuPy can use now, run for a few steps (it must fit: the measured peak beside the prediction), and one
    layer more, tried all the same (its row records the out-of-memory error, or that it fit after all)."""
    device.require_gpu("finding what fits on this GPU")
    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    free, total = cp.cuda.runtime.memGetInfo()
    L, _ = largest_layers(C, T, B, free, precision, policy, attention)
    rows = []
    for n_layer in (L, L + 1):
        cfg = _wide_gpt(C, T, n_layer)
        row = {"layers": n_layer, "predicted_bytes": int(_predict(cfg, B, T, precision, policy, attention))}
        rows.append(_measured_or_out_of_memory(row, cfg, B, T, precision, policy=policy, steps=steps,
                                               versions={"attention": attention} if attention == "flash" else None))
    return {"card": _card(), "date": datetime.date.today().isoformat(), "C": C, "T": T, "B": B,
            "precision": precision, "policy": policy, "attention": attention, "free_bytes": int(free),
            "gpu_bytes": int(total), "rows": rows}


def format_fits(result) -> str:
    lines = [f"GPT C{result['C']} T{result['T']} B{result['B']} {result['precision']} attention {result['attention']}, "
             f"checkpointing {result['policy']}, on {result['card']} ({result['date']}): "
             f"{result['free_bytes'] / 2**30:.1f} GiB free",
             f"{'layers':>7}{'predicted GiB':>15}{'peak GiB':>10}{'ms/step':>9}"]
    for r in result["rows"]:
        head = f"{r['layers']:>7}{r['predicted_bytes'] / 2**30:15.1f}"
        lines.append(head + (f"  {r['error']}" if "error" in r else f"{r['peak_bytes'] / 2**30:10.1f}{r['step_ms']:9.1f}"))
    return "\n".join(lines)


# lesson 12's techniques, each as the engine options it takes (beside the plain step): the row name, build() options
MEMORY_TECHNIQUES = (
    ("plain", {}),
    ("ce_chunks 16", {"ce_chunks": 16}),
    ("moments bf16", {"optimizer_state": "bf16"}),
    ("moments int8", {"optimizer_state": "int8"}),
    ("offload optimizer", {"offload_optimizer": True}),
    ("checkpointing full", {"policy": "full"}),
    ("checkpointing sqrt", {"policy": "sqrt"}),
    ("all but offload", {"ce_chunks": 16, "optimizer_state": "int8", "policy": "sqrt"}),
    ("GELU input half", {"gelu_in": "half"}),
    ("ce_chunks 8, GELU half", {"ce_chunks": 8, "gelu_in": "half"}),
    ("… and epilogues", {"ce_chunks": 8, "gelu_in": "half", "epilogue": "cublaslt"}),
    ("… epilogues, dfc in a pass", {"ce_chunks": 8, "gelu_in": "half", "epilogue": "cublaslt", "dgelu": "kernel"}),
    ("… and bf16 logits", {"ce_chunks": 8, "gelu_in": "half", "epilogue": "cublaslt", "dgelu": "kernel",
                           "logits": "half"}),
    ("… and bf16 dgelu", {"ce_chunks": 8, "gelu_in": "half", "epilogue": "cublaslt", "dgelu": "kernel",
                          "logits": "half", "dgelu_out": "half"}),
    ("… and bf16 dqkv", {"ce_chunks": 8, "gelu_in": "half", "epilogue": "cublaslt", "dgelu": "kernel",
                         "logits": "half", "dgelu_out": "half", "dqkv_out": "half"}),
)


def bench_memory(preset="gpt2", precision="bf16", steps=6, attention=None, techniques=MEMORY_TECHNIQUES) -> dict:
    """Lesson 12's techniques on one model, in one run: for each, engine_memory's prediction, then the step launched
    from Python (its pool peak is what the prediction describes: "peak_bytes", "step_ms") and, where the step can be
    captured, replayed as a CUDA graph ("graph_step_ms", "graph_peak_bytes": measure_engine's graph peak, the model
    and optimizer state plus the graph's pool; runs before StepGraph kept its capture-time copy of that state on the
    host counted the copy too). A technique this engine refuses records the refusal."""
    device.require_gpu("benchmarking the memory techniques")
    from ..engine import EngineError, engine_memory

    cfg, B = _cfg(preset)
    T = cfg.block_size
    versions = {"attention": attention} if attention else None
    att = attention or _default_attention(cfg, precision)
    rows = []
    for name, opts in techniques:
        kw = {"policy": opts.get("policy", "none"), "ce_chunks": opts.get("ce_chunks", 1),
              "optimizer_state": opts.get("optimizer_state", "fp32"),
              "offload_optimizer": opts.get("offload_optimizer", False)}
        # engine versions, not build() options: the GELU input's format and the products' epilogues
        gelu_in, epilogue = opts.get("gelu_in", "f32"), opts.get("epilogue", "none")
        dgelu, logits = opts.get("dgelu", "cublaslt"), opts.get("logits", "f32")
        dgelu_out, dqkv_out = opts.get("dgelu_out", "f32"), opts.get("dqkv_out", "f32")
        try:
            pred = engine_memory(cfg, B, T, precision, attention=att, half_gelu_in=gelu_in == "half",
                                 epilogue=epilogue == "cublaslt", dgelu_epilogue=dgelu == "cublaslt",
                                 half_logits=logits == "half", half_dgelu=dgelu_out == "half",
                                 half_dqkv=dqkv_out == "half", **kw)
        except ValueError as e:  # a technique this precision does not have (the epilogues in fp32)
            rows.append({"technique": name, **kw, "predicted_bytes": 0, "error": str(e)})
            continue
        row = {"technique": name, **kw, "predicted_bytes": int(pred["total"]), "host_bytes": int(pred.get("host", 0))}
        ver = dict(versions or {})
        for key, value, default in (("gelu_in", gelu_in, "f32"), ("epilogue", epilogue, "none"),
                                    ("dgelu", dgelu, "cublaslt"), ("logits", logits, "f32"),
                                    ("dgelu_out", dgelu_out, "f32"), ("dqkv_out", dqkv_out, "f32")):
            if value != default:
                row[key] = ver[key] = value
        ver = ver or None
        try:
            _measured_or_out_of_memory(row, cfg, B, T, precision, steps=steps, versions=ver, graphs="off", **kw)
            graph = _measured_or_out_of_memory({}, cfg, B, T, precision, steps=steps, versions=ver,
                                               graphs="auto", **kw)
            if graph.get("cuda_graph"):
                row.update(graph_step_ms=graph["step_ms"], graph_peak_bytes=graph["peak_bytes"])
                if "graph_pool_bytes" in graph:
                    row["graph_pool_bytes"] = graph["graph_pool_bytes"]
        except EngineError as e:
            row["error"] = str(e)
        rows.append(row)
    return {"card": _card(), "date": datetime.date.today().isoformat(), "preset": preset, "B": B, "T": T,
            "precision": precision, "attention": att, "rows": rows}


def _default_attention(cfg, precision, backend="hip"):
    from ..engine.gpu import GPUEngine, flash_unsupported

    want = GPUEngine.DEFAULT_VERSIONS[backend]["attention"]
    return "flash" if want == "flash" and flash_unsupported(cfg, backend, precision) is None else "cublas"


def format_memory(result) -> str:
    lines = [f"memory techniques, {result['preset']} B{result['B']} T{result['T']} {result['precision']}, attention "
             f"{result['attention']}, on {result['card']} ({result['date']})",
             "peak: CuPy's pool, the step launched from Python; graph: the same step replayed as a CUDA graph",
             f"{'technique':<20}{'predicted GiB':>14}{'peak GiB':>10}{'ms/step':>9}{'graph ms':>10}"]
    for r in result["rows"]:
        head = f"{r['technique']:<20}{r['predicted_bytes'] / 2**30:14.2f}"
        if "error" in r:
            lines.append(head + f"  {r['error'][:100]}")
        else:
            g = f"{r['graph_step_ms']:10.1f}" if "graph_step_ms" in r else f"{'-':>10}"
            lines.append(head + f"{r['peak_bytes'] / 2**30:10.2f}{r['step_ms']:9.1f}" + g)
    return "\n".join(lines)


def _measured_or_out_of_memory(row, cfg, B, T, precision, **kwargs) -> dict:
    """row with measure_engine's result, or with the out-of-memory error when the step does not fit; the pool is
    emptied after either, so the next run starts from the same free memory."""
    import cupy as cp

    try:
        row.update(measure_engine(cfg, B, T, precision, **kwargs))
    except cp.cuda.memory.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0][:160]}"
    finally:
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
    return row


def _wide_gpt(C, T, n_layer, vocab=50257):
    """The GPT of the "what fits" table: width C in heads of 64, context T, GPT-2's vocabulary."""
    from ..model.params import GPTConfig

    return GPTConfig(vocab_size=vocab, block_size=T, n_layer=n_layer, n_head=C // 64, d_model=C)


def _predict(cfg, B, T, precision, policy, attention):
    from ..engine import engine_memory

    return engine_memory(cfg, B, T, precision, policy, attention=attention)["total"]


def bench_checkpointing(presets=("course", "gpt2"), precisions=("fp32",), policies=("none", "selective", "full", "sqrt"),
                        steps=6, backend="hip", graphs=("off", "on")) -> dict:
    """Step time and peak memory per checkpointing policy, each step launched from Python (graphs "off") and
    replayed as a CUDA graph ("on": no launch overhead, so what is left of a policy's cost is its recompute)."""
    device.require_gpu("benchmarking activation checkpointing")
    from ..model.checkpointing import memory_model
    from ..engine import engine_memory

    rows = []
    for preset in presets:
        cfg, B = _cfg(preset)
        T = cfg.block_size
        for prec in precisions:
            for policy in policies:
                mm = memory_model(cfg, B, T, precision=prec, policy=policy)
                em = engine_memory(cfg, B, T, precision=prec, policy=policy)
                for mode in graphs:
                    r = measure_engine(cfg, B, T, prec, policy, backend=backend, steps=steps, graphs=mode)
                    rows.append({"preset": preset, "policy": policy, "batch": B, "T": T, "precision": prec,
                                 "graphs": mode, **r,
                                 "activation_bytes_measured": r["peak_bytes"] - r["model_bytes"],
                                 "activation_bytes_model": mm["activations"] + mm["recompute_peak"],
                                 "total_bytes_model": mm["total"], "total_bytes_engine_model": em["total"],
                                 "activation_bytes_engine_model": em["activations"] + em["working_set"]})
    return {"card": _card(), "date": datetime.date.today().isoformat(), "rows": rows}


def format_checkpointing(result) -> str:
    lines = [f"activation checkpointing on {result['card']} ({result['date']})",
             "graph: the step launched from Python (off) or replayed as a CUDA graph (on)",
             "peak = most bytes in use in CuPy's pool (with a graph: + its private pool); engine_memory = the engine's "
             "own tensors (gpullm_lessons.engine);",
             "memory_model = the NumPy reference's cache in one precision (gpullm_lessons.model.checkpointing)",
             f"{'preset':<8}{'prec':<6}{'policy':<10}{'graph':<6}{'ms/step':>9}{'peak GiB':>10}{'weights+opt':>12}"
             f"{'engine_memory':>15}{'ratio':>7}{'memory_model':>14}{'ratio':>7}"]
    for r in result["rows"]:
        mode = "on" if r.get("cuda_graph") else "off"
        lines.append(f"{r['preset']:<8}{r['precision']:<6}{r['policy']:<10}{mode:<6}{r['step_ms']:9.2f}"
                     f"{r['peak_bytes'] / 2**30:10.2f}{r['model_bytes'] / 2**30:12.2f}"
                     f"{r['total_bytes_engine_model'] / 2**30:15.2f}{r['total_bytes_engine_model'] / r['peak_bytes']:7.3f}"
                     f"{r['total_bytes_model'] / 2**30:14.2f}{r['total_bytes_model'] / r['peak_bytes']:7.3f}")
    return "\n".join(lines)


def profile_step(preset="course", precision="bf16", steps=5, backend="hip") -> dict:
    """Per-op time of training steps (engine.OpProfiler: CUDA events around every launcher and matrix product)."""
    device.require_gpu("profiling the training step")
    from .. import engine

    cfg, B = _cfg(preset)
    T = cfg.block_size
    eng = engine.build(cfg, backend, precision=precision)
    batches = _batches(cfg, B, T, steps + 2)
    for x, y in batches[:2]:                                             # warm-up: compilation, pool growth
        eng.train_step(x, y, lr=1e-4, weight_decay=0.1, grad_clip=1.0)
    prof = eng.enable_profiling()
    for x, y in batches[2:]:
        prof.step(eng.train_step, x, y, lr=1e-4, weight_decay=0.1, grad_clip=1.0)
    rows = prof.report()
    for r in rows:
        r["ms_per_step"] = r["ms"] / steps
    return {"card": _card(), "date": datetime.date.today().isoformat(), "preset": preset, "precision": precision,
            "backend": backend, "B": B, "T": T, "steps": steps, "step_ms": 1e3 * prof.wall / steps, "rows": rows}


def format_profile(result) -> str:
    lines = [f"{result['preset']} B{result['B']} T{result['T']} {result['precision']} {result['backend']} on "
             f"{result['card']} ({result['date']}): {result['step_ms']:.2f} ms per step",
             f"{'op':<40}{'calls/step':>11}{'ms/step':>9}{'share':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['op']:<40}{r['calls'] / result['steps']:11.1f}{r['ms_per_step']:9.3f}{100 * r['share']:7.1f}%")
    return "\n".join(lines)


# ---- GPU time per op: each distinct call of a step timed alone as a CUDA graph ---------------------------------------
def _call_key(name, args, kwargs):
    """A call's identity: the launcher's name and its arguments' shapes and dtypes (scalars by value)."""
    def d(a):
        if hasattr(a, "shape"):
            return tuple(a.shape), str(a.dtype)
        return a if isinstance(a, (int, float, str, bool, type(None))) else type(a).__name__
    return name, tuple(d(a) for a in args), tuple(sorted((k, d(v)) for k, v in kwargs.items()))


def _blaslt_tuning() -> bool:
    from ..runtime.blaslt import tuning

    return tuning()


def parse_variant(text: str):
    """"LABEL:key=value,key=value" (bench train --variant) -> (label, {key: value}); the keys are the engine's
    version names (GPUEngine.DEFAULT_VERSIONS) or ce_chunks (a positive integer). "LABEL:" alone: the defaults."""
    from ..engine import GPUEngine

    names = GPUEngine.DEFAULT_VERSIONS["hip"]

    label, sep, spec = text.partition(":")
    if not sep or not label.strip():
        raise ValueError(f"--variant {text!r}: write LABEL:key=value[,key=value] (e.g. v4:flash=v4)")
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise ValueError(f"--variant {text!r}: {item!r} is not key=value")
        if key == "ce_chunks":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--variant {text!r}: ce_chunks must be a positive integer, got {value!r}")
            out[key] = int(value)
        elif key not in names:
            raise ValueError(f"--variant {text!r}: {key!r} is not an engine version (one of "
                             f"{', '.join(sorted(names))}, or ce_chunks)")
        else:
            out[key] = value
    return label.strip(), out


def record_step_calls(eng, x, y, lr=1e-4) -> list:
    """Every distinct launcher call and matrix product of one eager train_step of a GPUEngine, in first-call order:
    [{"op", "key", "count", "fn", "args", "kwargs"}] (the arguments are kept, so each call can be replayed). The
    products with an epilogue (runtime/blaslt.py, versions epilogue "cublaslt") are ops named "gemm+" and the
    epilogue ("gemm+bias", "gemm+dgelu_bgrad")."""
    from ..runtime import blas, blaslt
    from .. import engine

    calls = {}

    def note(name, fn):
        def recorded(*a, **k):
            key = _call_key(name, a, k)
            if key in calls:
                calls[key]["count"] += 1
            else:
                calls[key] = {"op": name, "key": key, "count": 1, "fn": fn, "args": a, "kwargs": k}
            return fn(*a, **k)
        return recorded

    class Recorded:
        def __init__(self, module):
            self._module = module

        def __getattr__(self, name):
            fn = getattr(self._module, name)
            return note(name, fn) if callable(fn) else fn

    if not isinstance(eng, engine.GPUEngine):
        raise TypeError(f"record_step_calls: needs a GPUEngine (hip or numba backend), got {type(eng).__name__}")
    kernels, gemm, graphs, epilogue = eng.K, blas.gemm, eng.graphs, blaslt.matmul_epilogue

    def with_epilogue(*a, **k):
        return note("gemm+" + (a[3] if len(a) > 3 else k["epilogue"]), epilogue)(*a, **k)

    eng.K, blas.gemm, eng.graphs = Recorded(kernels), note("gemm", gemm), False      # one eager step
    blaslt.matmul_epilogue = with_epilogue   # the engine imports it at each call: the recorder is what it gets
    try:
        eng.train_step(x, y, lr=lr, weight_decay=0.1, grad_clip=1.0)
    finally:
        eng.K, blas.gemm, eng.graphs = kernels, gemm, graphs
        blaslt.matmul_epilogue = epilogue
    return list(calls.values())


def gpu_time_profile(preset="gpt2", precision="bf16", backend="hip", cfg=None, B=None, T=None, timer=None,
                     warmup=True, versions=None, with_torch=False, ce_chunks=1) -> dict:
    """GPU time of one training step, op by op. Each distinct call of an eager step (record_step_calls) is replayed
    alone as a CUDA graph of 10 calls (time_gpu_graph) and multiplied by its count per step.

    `profile` puts CUDA events around launches from Python, so a short kernel's row also holds the GPU's wait for
    Python; this measures the kernels themselves, and its total is about what a CUDA-graph replay of the step can
    reach. A call that cannot be captured (one that reads a device value on the host) is listed with ms None.
    timer(fn) -> seconds per call replaces the CUDA-graph timing, warmup=False skips the warm-up step (the tests run
    the bookkeeping in the simulator). with_torch: the same model's PyTorch eager step too, kernel by kernel
    (torch_gpu_time), under "torch"; format_gpu_time then compares them group by group (grouped_gpu_time).
    ce_chunks: the engine's loss head in that many chunks (lesson 12). CuPy's own elementwise operations between the
    launchers (a residual added into a gradient, a half bias gradient widened) are not launchers: they are not listed."""
    from .. import engine
    from .timing import time_gpu_graph

    if timer is None:
        device.require_gpu("timing the training step's kernels")
        timer = lambda fn: time_gpu_graph(fn, iters=10, reps=3)  # noqa: E731
    if cfg is None:
        cfg, B = _cfg(preset)
        T = cfg.block_size
    eng = engine.build(cfg, backend, precision=precision, graphs="off", versions=versions, ce_chunks=ce_chunks)
    x, y = _batches(cfg, B, T, 1)[0]
    if warmup:
        eng.train_step(x, y, lr=1e-4)                               # compile, fill the pool
    rows = []
    for c in record_step_calls(eng, x, y):
        try:
            sec = timer(lambda c=c: c["fn"](*c["args"], **c["kwargs"]))
        except Exception:  # noqa: BLE001 - not capturable: listed without a time
            sec = None
        shapes = [s for s in c["key"][1] if isinstance(s, tuple)][:3]
        rows.append({"op": c["op"], "shapes": str(shapes), "calls": c["count"],
                     "us_per_call": None if sec is None else 1e6 * sec,
                     "ms": None if sec is None else 1e3 * sec * c["count"]})
    total = sum(r["ms"] for r in rows if r["ms"] is not None)
    for r in rows:
        r["share"] = None if r["ms"] is None else r["ms"] / total
    out = {"card": _card() if device.has_gpu() else "the CUDA simulator (CPU)",
           "date": datetime.date.today().isoformat(), "preset": preset, "precision": precision, "backend": backend,
           "B": B, "T": T, "total_ms": total, "rows": rows, "versions": dict(eng.ver), "ce_chunks": ce_chunks,
           "blaslt_tune": _blaslt_tuning()}
    if with_torch:
        eng = None
        gc.collect()
        out["torch"] = torch_gpu_time(cfg, B, T, precision)
    return out


def format_gpu_time(result, top=20) -> str:
    by = {}
    for r in result["rows"]:
        t = by.setdefault(r["op"], [0.0, 0])
        t[0] += r["ms"] or 0.0
        t[1] += r["calls"]
    lines = [f"{result['preset']} B{result['B']} T{result['T']} {result['precision']} {result['backend']} on "
             f"{result['card']} ({result['date']}): GPU time of one step, summed over its calls: "
             f"{result['total_ms']:.2f} ms", f"{'op':<38}{'calls':>7}{'ms':>10}{'share':>8}"]
    for op, (ms, n) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{op:<38}{n:7d}{ms:10.3f}{100 * ms / result['total_ms']:7.1f}%")
    lines.append("largest single calls (x count):")
    for r in sorted((r for r in result["rows"] if r["ms"] is not None), key=lambda r: -r["ms"])[:top]:
        lines.append(f"  {r['ms']:8.3f} ms = {r['calls']:3d} x {r['us_per_call']:8.1f} us  {r['op']} {r['shapes']}")
    missing = [r["op"] for r in result["rows"] if r["ms"] is None]
    if missing:
        lines.append(f"not capturable, not timed: {', '.join(sorted(set(missing)))}")
    if result.get("torch"):
        lines.append(f"beside PyTorch {result['torch']['version']} eager, the same model (torch.profiler, kernel time "
                     f"per step: {result['torch']['total_ms']:.2f} ms):")
        lines.append(f"{'group':<24}{'ours ms':>9}{'PyTorch ms':>12}{'ours / PyTorch':>16}")
        for g, a, b in grouped_gpu_time(result):
            ratio = f"{a / b:16.2f}" if b else f"{'-':>16}"
            lines.append(f"{g:<24}{a:9.2f}{b:12.2f}" + ratio)
    return "\n".join(lines)


def step_timeline(preset: str = "course", precision: str = "bf16", backend: str = "hip", versions=None,
                  ce_chunks=1) -> dict:
    """One eager step and one CUDA-graph step of the engine, traced with CUPTI through torch.profiler: every kernel
    on the GPU's timeline (the libraries' among them, by name: which cuBLAS or cuBLASLt kernel ran each product),
    every launch call on the CPU's, and the step's phases (forward / backward / optimizer). versions, ce_chunks: the
    engine's (bench train's --epilogue, --gelu-in, --ce-chunks, ...)."""
    import datetime

    import cupy as cp
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from .. import engine
    from ..engine.profiler import range_hook
    from .profiling import step_span, trace_events

    info = device.require_gpu("tracing a training step")
    cfg, B = _cfg(preset)
    T = cfg.block_size
    x, y = _batches(cfg, B, T, 1)[0]
    out = {"card": info.gpu.name, "date": datetime.date.today().isoformat(), "preset": preset,
           "precision": precision, "backend": backend, "B": B, "T": T, "versions": versions or {},
           "ce_chunks": ce_chunks,
           "tool": f"torch.profiler {torch.__version__} (CUPTI activity trace), one step after 3 warm-up steps"}
    with range_hook(record_function):
        for mode, key in (("off", "eager"), ("on", "graph")):
            eng = engine.build(cfg, backend, precision=precision, graphs=mode, versions=versions, ce_chunks=ce_chunks)
            for _ in range(3):
                eng.train_step(x, y, lr=1e-4)
            cp.cuda.Device().synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("step"):
                    eng.train_step(x, y, lr=1e-4)
                    cp.cuda.Device().synchronize()
            ev = trace_events(prof)
            kernels = [e for e in ev if e["kind"] == "kernel"]
            out[key] = {"events": ev, "kernels": len(kernels),
                        "gpu_busy_us": round(sum(e["dur"] for e in kernels), 1), "span_us": step_span(ev)}
            del eng
            cp.get_default_memory_pool().free_all_blocks()
    return out
