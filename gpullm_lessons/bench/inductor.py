"""What torch.compile does to the course's GPT (lesson 14): what it keeps for the backward, and the kernels it runs.

`python -m gpullm_lessons.bench inductor --presets gpt2 --precisions bf16 --json F` measures, on one GPU, the PyTorch
GPT of `bench train` (train_step.torch_gpt) three ways:

- **eager's saved tensors**: every tensor autograd saves for the backward during one forward, through
  torch.autograd.graph.saved_tensors_hooks; the parameters (saved for the products' backward, kept anyway) are left
  out, and a storage is counted once however many views of it are saved;
- **torch.compile's saved tensors**: the same forward through AOTAutograd with Inductor's decompositions and
  partitioner (functorch's min_cut_rematerialization_partition) but no code generation, to read the partition: the
  forward graph's outputs past the loss are what the backward reads; those that are graph inputs (parameters, token
  ids) are left out. The rest is what the min-cut chose to keep; everything else it recomputes in the backward;
- **Inductor's kernels**: one compiled training step under torch.profiler, kernel by kernel (triton_* are the kernels
  Inductor generated; their names list the ops fused into them), grouped as `bench gputime` groups ours.

Each part that fails records its error instead of its result, so one run on a GPU says what it could.
"""

from __future__ import annotations

import datetime
import re
from collections import Counter

import numpy as np

from .. import device

DTYPE_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.int64": 8, "torch.int32": 4,
               "torch.bool": 1, "torch.uint8": 1}  # fmt: skip


def tensor_kinds(tensors) -> list:
    """[(shape, dtype, count, bytes)] for (shape tuple, dtype str) pairs, largest total first."""
    counts = Counter((tuple(int(s) for s in shape), str(dtype)) for shape, dtype in tensors)
    rows = []
    for (shape, dtype), n in counts.items():
        each = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES.get(dtype, 4)
        rows.append({"shape": list(shape), "dtype": dtype.replace("torch.", ""), "count": n, "bytes": n * each})
    return sorted(rows, key=lambda r: -r["bytes"])


def fused_ops(kernel: str) -> list | None:
    """The ops an Inductor kernel's name lists ("triton_poi_fused_add_gelu_mul_3" -> ["add", "gelu", "mul"]); None
    for a kernel Inductor did not generate. Inductor joins the aten op names with "_", so an op whose own name has an
    underscore (native_layer_norm) comes back in pieces: the names are for reading, not for counting ops exactly."""
    m = re.match(r"^triton_(?:poi|red|per|tem|for)_fused_(.*?)(?:_\d+)?$", kernel)
    if m is None:
        return None
    return [p for p in m.group(1).split("_") if p and not p.isdigit()]


def kernel_kind(kernel: str) -> str:
    """Inductor's kernel families by their name's prefix: pointwise, reduction, persistent reduction, template (a
    generated matrix product); a library kernel otherwise."""
    for prefix, kind in (("triton_poi", "generated pointwise"), ("triton_red", "generated reduction"),
                         ("triton_per", "generated reduction"), ("triton_tem", "generated matrix product")):
        if kernel.startswith(prefix):
            return kind
    return "library"


def _saved_eager(model, x, y, autocast):
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, kept = set(), []

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            whole = storage.nbytes() == t.numel() * t.element_size()   # a view of a larger tensor: count all of it
            kept.append((tuple(t.shape) if whole else (storage.nbytes() // t.element_size(),), str(t.dtype)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        loss = model(x, y)
    loss.backward()
    return {"kept": kept}


def _saved_compiled(model, x, y, autocast):
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = []

    def fw(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        values = list(out.args[0])
        saved = []
        for n in values[1:]:   # values[0]: the loss; the rest is what the backward reads
            val = getattr(n, "meta", {}).get("val") if hasattr(n, "meta") else None
            if val is None or not hasattr(val, "shape"):
                continue        # a symbolic size, not a tensor
            saved.append({"input": n.op == "placeholder", "shape": tuple(val.shape), "dtype": str(val.dtype)})
        graphs.append(saved)
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        return make_boxed_func(gm.forward)

    from torch._inductor.decomposition import select_decomp_table

    torch._dynamo.reset()   # Inductor's decompositions first, as compile_fx does: the partitioner sees the same graph
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=fw, bw_compiler=bw,
                                                         partition_fn=min_cut_rematerialization_partition,
                                                         decompositions=select_decomp_table()))
    with autocast():
        loss = compiled(x, y)
    loss.backward()
    torch._dynamo.reset()
    saved = [s for g in graphs for s in g]
    return {"kept": [(s["shape"], s["dtype"]) for s in saved if not s["input"]], "graphs": len(graphs),
            "inputs_kept": tensor_kinds([(s["shape"], s["dtype"]) for s in saved if s["input"]])}


def torch_compile_anatomy(preset="gpt2", precision="bf16", steps=3, with_kernels=True, cfg=None, B=None) -> dict:
    """The three measurements of the module docstring for one preset (or cfg with batch B, T = its block size):
    {"saved": {"eager": ..., "compile": ...}, "kernels": ...}."""
    device.require_gpu("looking inside torch.compile's step")
    import torch

    from .train_step import _batches, _card, _cfg, gpu_time_group, torch_gpu_time, torch_gpt

    if cfg is None:
        cfg, B = _cfg(preset)
    T = cfg.block_size
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def autocast():
        return torch.autocast("cuda", dtype=dtype, enabled=dtype is not None)

    xb, yb = _batches(cfg, B, T, 1)[0]
    x, y = torch.from_numpy(xb).long().cuda(), torch.from_numpy(yb).long().cuda()
    out = {"card": _card(), "date": datetime.date.today().isoformat(), "preset": preset, "B": B, "T": T,
           "precision": precision, "torch": torch.__version__, "saved": {}}
    for name, fn in (("eager", _saved_eager), ("compile", _saved_compiled)):
        model = torch_gpt(cfg)
        try:
            got = fn(model, x, y, autocast)
            kinds = tensor_kinds(got.pop("kept"))
            out["saved"][name] = {"bytes": sum(r["bytes"] for r in kinds), "kinds": kinds, **got}
        except Exception as e:  # noqa: BLE001 - recorded: one run says what it could
            out["saved"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        del model
        torch.cuda.empty_cache()
    if with_kernels:
        try:
            prof = torch_gpu_time(cfg, B, T, precision, steps=steps, compile=True)
            kernels = [{"kernel": k, "ms": ms, "kind": kernel_kind(k), "group": gpu_time_group(k),
                        "fused": fused_ops(k)} for k, ms in sorted(prof["kernels"].items(), key=lambda kv: -kv[1])]
            groups = {}
            for r in kernels:
                g = groups.setdefault(r["kind"], {"ms": 0.0, "kernels": 0})
                g["ms"] += r["ms"]
                g["kernels"] += 1
            out["kernels"] = {"total_ms": prof["total_ms"], "by_kind": groups, "rows": kernels}
        except Exception as e:  # noqa: BLE001
            out["kernels"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return out


def format_anatomy(result, top=15) -> str:
    GiB = 2**30
    lines = [f"torch.compile on {result['preset']} B{result['B']} T{result['T']} {result['precision']}, torch "
             f"{result['torch']}, {result['card']} ({result['date']})"]
    for name, s in result["saved"].items():
        if "error" in s:
            lines.append(f"saved for the backward, {name}: {s['error']}")
            continue
        lines.append(f"saved for the backward, {name}: {s['bytes'] / GiB:.2f} GiB")
        for r in s["kinds"][:8]:
            lines.append(f"  {r['count']:4d} x {str(tuple(r['shape'])):<22} {r['dtype']:<9} {r['bytes'] / GiB:7.3f} GiB")
    k = result.get("kernels")
    if k and "error" in k:
        lines.append(f"kernels: {k['error']}")
    elif k:
        lines.append(f"one compiled step's kernels: {k['total_ms']:.2f} ms of GPU time")
        for kind, g in sorted(k["by_kind"].items(), key=lambda kv: -kv[1]["ms"]):
            lines.append(f"  {kind:<26}{g['kernels']:5d} kernels {g['ms']:9.2f} ms")
        for r in k["rows"][:top]:
            lines.append(f"  {r['ms']:8.3f} ms  {r['kernel'][:100]}")
    return "\n".join(lines)
