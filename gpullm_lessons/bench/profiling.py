"""Why a kernel is as fast as it is: Nsight Compute's counters per kernel version, NVTX ranges, a step's timeline.

``ncu_kernels`` runs the kernel benchmark's cases under Nsight Compute (``ncu``) and returns per-kernel counters:
DRAM throughput, sectors per request, achieved occupancy, registers per thread, warp stall reasons.

    python -m gpullm_lessons.bench ncu [--ops softmax,layernorm,crossentropy,adamw] [--json PATH]
    python -m gpullm_lessons.bench timeline [--presets course]   (one eager and one CUDA-graph step)

On AMD GPUs the same questions are answered by ROCm's profilers: ``rocprofv3 --kernel-trace --stats -- python ...``
for per-kernel GPU time, and ``rocprof-compute profile -n run -- python ...`` (formerly omniperf) for memory
throughput, occupancy and stall counters.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from .. import device

# A kernel that does nothing: launched before each profiled version with grid size k + 1, it tells ncu's rows apart.
_MARKER_SRC = r"""
extern "C" __global__ void bench_marker(int k) { }
"""
_kernels = {}


def marker_kernel():
    """The empty kernel `bench_marker` (CuPy RawKernel, compiled once): launched with grid k + 1 before the k-th
    profiled call, it tells that call's kernels apart in ncu's rows (_attribute)."""
    if "bench_marker" not in _kernels:
        import cupy as cp
        module = cp.RawModule(code=_MARKER_SRC)
        _kernels["bench_marker"] = module.get_function("bench_marker")
    return _kernels["bench_marker"]


# ---- Nsight Compute -------------------------------------------------------------------------------------------

STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "mio_throttle", "lg_throttle",
          "math_pipe_throttle", "wait", "not_selected", "selected", "no_instruction", "branch_resolving",
          "dispatch_stall", "drain", "imc_miss", "sleeping", "tex_throttle", "misc")
METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct_of_peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "launch__registers_per_thread": "registers_per_thread",
    "launch__grid_size": "grid_size",
    "launch__block_size": "block_size",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "ld_sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "ld_requests",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": "st_sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum": "st_requests",
    **{f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio": f"stall_{s}" for s in STALLS},
    # how busy each pipe of the multiprocessor was (% of its peak while the SM was active): integer and compare/select
    # (alu), float add/multiply/fma (fma), the tensor cores (tensor), special functions such as exp2 (xu)
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active": "pipe_alu_pct",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "pipe_fma_pct",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "pipe_tensor_pct",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "pipe_xu_pct",
    "smsp__inst_executed.sum": "instructions",
    # the share of cycles on which a scheduler issued an instruction: low with few warps and long dependency chains
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
}

CORE_METRICS = ["gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
                "launch__grid_size"]


def _number(text: str):
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> list:
    """Rows of `ncu --csv --page raw` (a header row, a units row, then one row per kernel) as dicts of our names."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    reader = list(csv.reader(io.StringIO("\n".join(lines))))
    header, body = reader[0], reader[1:]
    if body and body[0] and body[0][0] == "":              # the units row
        body = body[1:]
    rows = []
    for rec in body:
        cell = dict(zip(header, rec))
        row = {"kernel": cell.get("Kernel Name", ""), "id": cell.get("ID", "")}
        for metric, name in METRICS.items():
            if metric in cell:
                row[name] = _number(cell[metric])
        if row.get("grid_size") is None and cell.get("Grid Size"):     # "(3, 1, 1)": the launch's grid
            dims = [_number(d) or 1 for d in cell["Grid Size"].strip("()").split(",")]
            row["grid_size"] = float(np.prod(dims))
        rows.append(row)
    return rows


def _attribute(kernel_rows: list, labels: list) -> list:
    """Each kernel row after marker k (its grid size is k + 1) belongs to labels[k]; markers themselves dropped."""
    out, current = [], None
    for row in kernel_rows:
        if row["kernel"].startswith("bench_marker"):
            k = int(row.get("grid_size") or 0) - 1
            current = labels[k] if 0 <= k < len(labels) else None
            continue
        if current is not None:
            out.append(dict(current, **row))
    return out


def summarise(rows: list) -> list:
    """One line per (op, backend, version): the longest kernel's counters (the one that dominates its time),
    the sum of durations, sectors per request and the three largest stall reasons."""
    groups = {}
    for r in rows:
        groups.setdefault((r["op"], r["backend"], r["version"]), []).append(r)
    out = []
    for (op, backend, version), rs in groups.items():
        main = max(rs, key=lambda r: r.get("duration_ns") or 0)
        line = {"op": op, "backend": backend, "version": version, "kernels": len(rs),
                "duration_us": sum((r.get("duration_ns") or 0) for r in rs) / 1e3, "main_kernel": main["kernel"][:80]}
        for key in ("dram_pct_of_peak", "achieved_occupancy_pct", "theoretical_occupancy_pct", "registers_per_thread",
                    "grid_size", "block_size", "sm_pct_of_peak", "pipe_alu_pct", "pipe_fma_pct", "pipe_tensor_pct",
                    "pipe_xu_pct", "issue_active_pct", "instructions"):
            line[key] = main.get(key)
        for kind in ("ld", "st"):
            sec, req = main.get(f"{kind}_sectors"), main.get(f"{kind}_requests")
            line[f"{kind}_sectors_per_request"] = sec / req if sec and req else None
        read, write = sum((r.get("dram_read_bytes") or 0) for r in rs), sum((r.get("dram_write_bytes") or 0) for r in rs)
        line["dram_bytes"] = read + write
        stalls = {s: main.get(f"stall_{s}") for s in STALLS if main.get(f"stall_{s}") is not None}
        line["top_stalls"] = sorted(stalls.items(), key=lambda kv: -kv[1])[:3]
        out.append(line)
    return out


def ncu_kernels(ops=None, small: bool = False, ncu: str = None, timeout: float = 900) -> dict:
    """Nsight Compute counters for every kernel version of `ops` (and PyTorch's), one profiled call each."""
    import datetime
    info = device.require_gpu("profiling kernels with Nsight Compute")
    ncu = ncu or shutil.which("ncu")
    if not ncu:
        raise FileNotFoundError("Nsight Compute's `ncu` is not on PATH (it ships with the CUDA toolkit)")
    with tempfile.TemporaryDirectory() as tmp:
        labels_path, log = os.path.join(tmp, "labels.json"), os.path.join(tmp, "ncu.csv")
        target = [sys.executable, "-m", "gpullm_lessons.bench", "ncu-target", "--labels", labels_path]
        if ops:
            target += ["--ops", ",".join(ops)]
        if small:
            target.append("--small")
        for metrics in (list(METRICS), CORE_METRICS):    # a toolkit that lacks a metric: the core set
            # --clock-control none: measure the card at the clocks it runs (ncu would otherwise lock them to base)
            cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw",
                   "--log-file", log,
                   "--metrics", ",".join(metrics), *target]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if proc.returncode == 0 and os.path.exists(labels_path):
                break
        else:
            tail = open(log).read()[-1500:] if os.path.exists(log) else (proc.stderr or proc.stdout)[-1500:]
            raise RuntimeError(f"ncu failed (exit {proc.returncode}): {tail}")
        with open(labels_path) as f:
            labels = json.load(f)
        with open(log) as f:
            kernels = _attribute(parse_ncu_csv(f.read()), labels)
    return {"card": info.gpu.name, "date": datetime.date.today().isoformat(),
            "tool": "Nsight Compute (ncu --csv --page raw), one profiled call per version",
            "metrics": {m: METRICS[m] for m in metrics}, "kernels": kernels, "rows": summarise(kernels)}


def format_ncu(result: dict) -> str:
    """The counters that explain a memory-bound kernel's speed, one line per version (≤ 100 characters)."""
    lines = [f"{result['card']} ({result['date']}), Nsight Compute, one call per version",
             f"{'op':<13}{'backend':<8}{'version':<9}{'us':>8}{'DRAM %':>8}{'sect/req':>9}{'occ %':>7}{'regs':>6}"
             f"  top stall (cycles per issue)"]
    for r in result["rows"]:
        spr = r.get("ld_sectors_per_request")
        stall = ", ".join(f"{k} {v:.1f}" for k, v in r["top_stalls"][:2])
        stall = stall if len(stall) <= 30 else stall[:29] + "…"
        lines.append(f"{r['op']:<13}{r['backend']:<8}{str(r['version'])[:8]:<9}{r['duration_us']:8.1f}"
                     f"{(r.get('dram_pct_of_peak') or 0):8.0f}{(spr or 0):9.1f}"
                     f"{(r.get('achieved_occupancy_pct') or 0):7.0f}{int(r.get('registers_per_thread') or 0):6d}  {stall}")
    return "\n".join(lines)


def format_pipes(result: dict, op: str) -> str:
    """Where the main kernel of each version of `op` spends its issue slots (≤ 100 characters a line): how often a
    scheduler issued, how busy the tensor cores, the integer (alu), float (fma) and special-function (xu) pipes were,
    the achieved occupancy (% of the multiprocessor's warp slots), the instructions, and the largest stall (cycles per
    issued instruction)."""
    lines = [f"Nsight Compute, {result['card']} ({result['date']}), {op}; us: all kernels, the rest: the longest",
             f"{'version':<10}{'us':>8}{'issue %':>8}{'tensor %':>9}{'alu %':>7}{'fma %':>7}{'xu %':>6}{'occ %':>6}"
             f"{'M instr':>8}  top stall"]
    for r in result["rows"]:
        if r["op"] != op:
            continue
        pct = lambda k, w: f"{r[k]:{w}.0f}" if r.get(k) is not None else f"{'-':>{w}}"  # noqa: E731
        instr = f"{r['instructions'] / 1e6:8.1f}" if r.get("instructions") else f"{'-':>8}"
        stall = ", ".join(f"{k} {v:.1f}" for k, v in r["top_stalls"][:1])
        label = "PyTorch" if r.get("backend") == "torch" else str(r["version"])[:9]
        lines.append(f"{label:<10}{r['duration_us']:8.1f}{pct('issue_active_pct', 8)}"
                     f"{pct('pipe_tensor_pct', 9)}{pct('pipe_alu_pct', 7)}{pct('pipe_fma_pct', 7)}{pct('pipe_xu_pct', 6)}"
                     f"{pct('achieved_occupancy_pct', 6)}{instr}  {stall}")
    return "\n".join(lines)


def counters(ncu: dict, kernels: dict, op: str) -> list:
    """Per version of `op`: Nsight Compute's counters beside the kernel benchmark's row of the same version.

    `moved` is the DRAM bytes ncu counted (reads + writes; writes still held in L2 when the kernel ends are not yet
    counted, so a kernel that moves exactly the minimum reads a little under 1.0) over the minimum bytes the
    benchmark's case counts: above 1, the version reads or writes some bytes more than once."""
    minimum = {(r["backend"], str(r["version"])): r for r in kernels.get("rows", []) if r["op"] == op and "bytes" in r}
    out = []
    for r in ncu["rows"]:
        if r["op"] != op:
            continue
        bench_row = minimum.get((r["backend"], str(r["version"])))
        out.append({"backend": r["backend"], "version": r["version"], "us": r["duration_us"],
                    "dram_MB": r["dram_bytes"] / 1e6, "moved": r["dram_bytes"] / bench_row["bytes"] if bench_row else None,
                    "dram_pct": r.get("dram_pct_of_peak"), "occupancy_pct": r.get("achieved_occupancy_pct"),
                    "registers": r.get("registers_per_thread"), "ld_sectors_per_request": r.get("ld_sectors_per_request"),
                    "grid": r.get("grid_size"), "kernels": r["kernels"], "top_stall": (r.get("top_stalls") or [[None]])[0][0]})
    return out


def format_counters(ncu: dict, kernels: dict, op: str) -> str:
    """The counters that say why each version of `op` takes its time (one line per version, <= 100 characters)."""
    lines = [f"Nsight Compute on {ncu['card']} ({ncu['date']}), one call of each version at the benchmark's shape",
             "moved: DRAM bytes counted / the minimum bytes; sect/req: 32-byte sectors per warp load (4: one float a "
             "lane; 16: float4)",
             f"{'backend':<8}{'version':<9}{'us':>8}{'DRAM MB':>9}{'moved':>7}{'DRAM %':>8}{'occ %':>7}{'regs':>6}"
             f"{'sect/req':>9}  main stall"]
    for r in counters(ncu, kernels, op):
        moved = f"{r['moved']:7.2f}" if r["moved"] is not None else f"{'-':>7}"
        lines.append(f"{r['backend']:<8}{str(r['version'])[:8]:<9}{r['us']:8.1f}{r['dram_MB']:9.0f}{moved}"
                     f"{(r['dram_pct'] or 0):8.0f}{(r['occupancy_pct'] or 0):7.0f}{int(r['registers'] or 0):6d}"
                     f"{(r['ld_sectors_per_request'] or 0):9.1f}  {r['top_stall'] or ''}")
    return "\n".join(lines)


# ---- NVTX ranges and a step timeline --------------------------------------------------------------------------



def trace_events(prof, t_ref=None):
    """Kernels (GPU) and launches / phases (CPU) of a torch.profiler run, in microseconds from the first event."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    keep = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset", "cuda_runtime": "runtime",
            "cuda_driver": "runtime", "user_annotation": "phase"}
    rows = [{"kind": keep[e["cat"]], "name": e.get("name", "")[:70], "ts": float(e["ts"]), "dur": float(e.get("dur", 0)),
             "stream": (e.get("args") or {}).get("stream")}
            for e in events if e.get("ph") == "X" and e.get("cat") in keep]
    if not rows:
        return []
    t0 = min(r["ts"] for r in rows)
    for r in rows:
        r["ts"] = round(r["ts"] - t0, 2)
        r["dur"] = round(r["dur"], 2)
    return sorted(rows, key=lambda r: r["ts"])


def step_span(events: list) -> float:
    """Microseconds from the step's first call into CUDA to the end of its last GPU work (kernel, copy or memset):
    what the step costs the GPU's timeline, without the profiler's own bookkeeping around it."""
    gpu = [e for e in events if e["kind"] in ("kernel", "memcpy", "memset")]
    calls = [e for e in events if e["kind"] in ("runtime", "kernel", "memcpy", "memset")]
    if not gpu:
        return 0.0
    return round(max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in calls), 1)


def format_timeline(result: dict) -> str:
    """Per mode: kernels, GPU busy time, the step's span, and the GPU's idle share (waiting for the CPU)."""
    lines = [f"{result['preset']} B{result['B']} T{result['T']} {result['precision']} on {result['card']} "
             f"({result['date']})"]
    for key in ("eager", "graph"):
        m = result.get(key)
        if m:
            idle = 1 - m["gpu_busy_us"] / m["span_us"] if m["span_us"] else 0.0
            launches = sum(1 for e in m["events"] if e["kind"] == "runtime" and "aunch" in e["name"])
            lines.append(f"  {key:<6} {m['kernels']:4d} kernels, {launches:4d} launch calls from the CPU, "
                         f"GPU busy {m['gpu_busy_us'] / 1e3:6.2f} of {m['span_us'] / 1e3:6.2f} ms "
                         f"({100 * idle:4.1f}% idle)")
    return "\n".join(lines)


def kernel_family(name: str) -> str:
    """A kernel's name without its template arguments and signature; every cuBLAS product is "gemm (cuBLAS)"
    (its kernels are named after their tiles: nvjet_*, sm90_xmma_gemm_*, cutlass_*), CuPy's own kernels "CuPy"."""
    low = name.lower()
    if any(k in low for k in ("gemm", "cutlass", "xmma", "cublas", "nvjet")):
        return "gemm (cuBLAS)"
    if low.startswith("cupy_"):
        return "CuPy elementwise / reduction"
    for sep in ("<", "(", "["):
        name = name.split(sep)[0]
    return name.strip() or "?"


def kernel_families(result: dict, mode: str = "graph") -> list:
    """The kernels of one traced step (step_timeline's `mode`: "eager" or "graph") grouped by family: (family,
    launches, GPU microseconds), most time first."""
    groups = {}
    for e in result[mode]["events"]:
        if e["kind"] == "kernel":
            g = groups.setdefault(kernel_family(e["name"]), [0, 0.0])
            g[0] += 1
            g[1] += e["dur"]
    return sorted(((k, n, us) for k, (n, us) in groups.items()), key=lambda r: -r[2])


def format_kernel_families(result: dict, mode: str = "graph", top: int = 10) -> str:
    fams = kernel_families(result, mode)
    busy = sum(us for _, _, us in fams) or 1.0
    lines = [f"{mode} step, {result['preset']} {result['precision']}: GPU time by kernel family (CUPTI)",
             f"{'kernel':<44}{'launches':>9}{'ms':>8}{'share':>7}"]
    for name, n, us in fams[:top]:
        lines.append(f"{name[:43]:<44}{n:9d}{us / 1e3:8.2f}{100 * us / busy:6.1f}%")
    rest = fams[top:]
    if rest:
        us = sum(r[2] for r in rest)
        lines.append(f"{f'{len(rest)} more families':<44}{sum(r[1] for r in rest):9d}{us / 1e3:8.2f}{100 * us / busy:6.1f}%")
    return "\n".join(lines)
