"""Plots for the course: the loss curve (used by the training script and the notebooks).

Without a display (a server, CI) matplotlib is switched to its file-only Agg backend, unless pyplot is already
loaded or MPLBACKEND is set (Jupyter sets its inline backend itself).
"""
from __future__ import annotations

import os
import sys
from typing import Iterable, Optional


def _pyplot():
    import matplotlib

    headless = sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    if headless and "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(log_records: Iterable[dict], path=None, entropy: Optional[float] = None, ax=None):
    """Train loss per step, val loss where evaluated, and the byte-unigram entropy line; returns the figure.

    log_records: dicts with "step" and "loss", and "val_loss" on evaluation steps (the lines of log.jsonl).
    path: also save the figure there (PNG). entropy: draw it as the bar to beat (nats per byte).
    ax: draw into this matplotlib Axes instead of a new figure.
    """
    records = list(log_records)
    if ax is None:
        fig, ax = _pyplot().subplots(figsize=(7, 4))
    else:
        fig = ax.figure
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.8, label="train loss (one batch)")
    if val:
        ax.plot(*zip(*val), "o-", lw=2, label="val loss (held-out 10%)")
    if entropy is not None:
        ax.axhline(entropy, color="gray", ls="--", lw=1,
                   label=f"byte-unigram entropy {entropy:.3f} (the bar to beat)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("GPT training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def plot_grid_mapping(n: int, threads_per_block: int, ax=None):
    """Which block and thread own which element of a 1-D array: one cell per element, coloured by block,
    labelled with threadIdx.x; the guard `if i < n` idles the threads past the end (hatched)."""
    plt = _pyplot()
    blocks = (n + threads_per_block - 1) // threads_per_block
    total = blocks * threads_per_block
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(0.45 * total + 1, 16), 1.9))
    else:
        fig = ax.figure
    colors = plt.get_cmap("tab10")
    for i in range(total):
        b, t = divmod(i, threads_per_block)
        idle = i >= n
        ax.add_patch(plt.Rectangle((i, 0), 0.95, 1, color=colors(b % 10), alpha=0.25 if idle else 0.7,
                                   hatch="//" if idle else None))
        ax.text(i + 0.47, 0.5, str(t), ha="center", va="center", fontsize=8)
        if t == 0:
            ax.text(i + threads_per_block / 2, 1.15, f"block {b}", ha="center", fontsize=9)
    ax.text(total + 0.2, 0.5, f"n = {n}", va="center", fontsize=9)
    ax.set_xlim(-0.2, total + 2.5)
    ax.set_ylim(-0.5, 1.5)
    ax.axis("off")
    ax.set_title(f"{blocks} blocks x {threads_per_block} threads: element i = blockIdx.x * blockDim.x + threadIdx.x "
                 f"(hatched: i >= n, idle)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_ceilings(ceilings: dict, ax=None):
    """Bar chart of the measured ceilings (copy GB/s on the left axis, matmul TFLOP/s on the right)."""
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.2))
    else:
        fig = ax.figure
    ax.bar([0], [ceilings["copy"]["GB/s"]], color="tab:blue")
    ax.set_ylabel("copy GB/s", color="tab:blue")
    ax2 = ax.twinx()
    keys = [k for k in ("matmul_fp32", "matmul_fp16", "matmul_bf16") if "TFLOP/s" in ceilings.get(k, {})]
    ax2.bar(range(1, len(keys) + 1), [ceilings[k]["TFLOP/s"] for k in keys], color="tab:orange")
    ax2.set_ylabel("matmul TFLOP/s", color="tab:orange")
    ax.set_xticks(range(len(keys) + 1), ["copy"] + [k.replace("matmul_", "matmul ") for k in keys])
    ax.set_title(f"ceilings of {ceilings['card']} ({ceilings['date']})")
    fig.tight_layout()
    return fig


def plot_roofline(result: dict, path=None, ax=None):
    """Roofline of a kernel benchmark (bench.bench_kernels): achieved TFLOP/s against arithmetic intensity
    (FLOPs per byte), under the measured copy-bandwidth slope and the fp32 matmul ceiling of the same run."""
    import numpy as np
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 5))
    else:
        fig = ax.figure
    bw = result["ceilings"]["copy"]["GB/s"] * 1e9
    peak = result["ceilings"]["matmul_fp32"]["TFLOP/s"] * 1e12
    rows = [r for r in result["rows"] if "error" not in r]
    ai = np.logspace(-1, 3, 200) if any(r["bound"] == "compute" for r in rows) else np.logspace(-1, 1.5, 200)
    ax.loglog(ai, np.minimum(ai * bw, peak) / 1e12, "k-", lw=1.5, label="ceiling (copy GB/s, fp32 matmul)")
    markers = {"numba": "o", "hip": "s", "torch": "^"}
    colors = plt.get_cmap("tab10")
    ops = sorted({r["op"] for r in rows})
    for r in rows:
        x = r["flops"] / r["bytes"]
        ax.scatter(x, r["TFLOP/s"], marker=markers.get(r["backend"], "x"), color=colors(ops.index(r["op"]) % 10),
                   s=40, alpha=0.8)
        ax.annotate(f"{r['backend'][0]}{r['version'] if r['backend'] != 'torch' else ''}", (x, r["TFLOP/s"]),
                    fontsize=6, xytext=(3, 2), textcoords="offset points")
    for i, op in enumerate(ops):
        ax.scatter([], [], color=colors(i % 10), label=op)
    for b, m in markers.items():
        ax.scatter([], [], marker=m, color="gray", label=b)
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"kernels on {result['card']} ({result['date']})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
