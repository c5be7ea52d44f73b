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


# ---- lesson 05: causal attention backward, fused cross-entropy -----------------------------------------------------
def plot_attention_backward_mask(T: int = 8, t: int = 5, s: int = 2, ax=None):
    """Causal attention backward on one head's (T, T) matrices: which entries the kernels compute and which the
    mask lets them skip (att = 0 above the diagonal), and which entries feed dq[t] (row t) and dk[s], dv[s]
    (column s). Rows are query positions t, columns key positions s."""
    import numpy as np
    plt = _pyplot()
    if ax is None:
        fig, axes = plt.subplots(1, 3, figsize=(13, 5.2))
    else:
        axes, fig = ax, ax[0].figure
    lower = np.tril(np.ones((T, T), dtype=bool))
    panels = [
        ("datt = dy v^T, dpre = softmax bwd:\ncomputed for s <= t, skipped above",
         lower, "tab:blue"),
        (f"dq[t={t}] = scale * sum over s <= {t} of\ndpre[{t}, s] k[s]   (row t)",
         lower & (np.arange(T)[:, None] == t), "tab:orange"),
        (f"dk[{s}] = scale * sum over t >= {s} of dpre[t, {s}] q[t]\n"
         f"dv[{s}] = sum over t >= {s} of att[t, {s}] dy[t]  (column s)",
         lower & (np.arange(T)[None, :] == s), "tab:green"),
    ]
    for a, (title, used, color) in zip(axes, panels):
        for i in range(T):
            for j in range(T):
                if j > i:      # masked: att = 0, never computed, never read
                    a.add_patch(plt.Rectangle((j, i), 1, 1, facecolor="0.93", edgecolor="0.75", hatch="//", lw=0.5))
                else:
                    a.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=color if used[i, j] else "white",
                                              alpha=0.75 if used[i, j] else 1.0, edgecolor="0.6", lw=0.5))
        a.set_xlim(0, T)
        a.set_ylim(T, 0)
        a.set_aspect("equal")
        a.set_xticks(np.arange(T) + 0.5, [str(k) for k in range(T)], fontsize=7)
        a.set_yticks(np.arange(T) + 0.5, [str(k) for k in range(T)], fontsize=7)
        a.set_xlabel("key position s")
        a.set_ylabel("query position t")
        a.set_title(title, fontsize=9)
    n_skip = T * (T - 1) // 2
    fig.suptitle(f"one head, T = {T}: {T * (T + 1) // 2} of {T * T} entries computed; the hatched {n_skip} "
                 f"(s > t, att = 0) are skipped: {100 * n_skip / (T * T):.0f}% of the (T, T) work "
                 f"(-> 50% as T grows)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.9))
    return fig


def plot_crossentropy_row_pass(V: int = 16, threads: int = 4, target: int = 6, N: int = 8, seed: int = 0, ax=None):
    """The fused cross-entropy backward on one row of logits, one block of `threads` threads per row:
    pass 1, thread k folds logits k, k + threads, ... into a running (max m, sum s) pair (online softmax);
    the block merges the pairs (a tree); pass 2 reads the row again and writes
    dlogits_j = (exp(x_j - m) / s - [j == target]) / N directly: the (N, V) probabilities are never stored."""
    import numpy as np
    plt = _pyplot()
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal(V) * 1.5, 1).astype(np.float32)
    pairs = []
    for k in range(threads):                       # pass 1: online softmax per thread slice
        m, s = -np.inf, 0.0
        for v in x[k::threads]:
            if v > m:
                s, m = s * np.exp(m - v) + 1.0, v
            else:
                s += np.exp(v - m)
        pairs.append((float(m), float(s)))
    m_row = max(p[0] for p in pairs)
    s_row = sum(p[1] * np.exp(p[0] - m_row) for p in pairs)   # merge
    d = (np.exp(x - m_row) / s_row - (np.arange(V) == target)) / N
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(1.0 + 0.75 * V, 16), 5.2))
    else:
        fig = ax.figure
    colors = plt.get_cmap("tab10")
    y_in, y_pair, y_row, y_out = 4.2, 2.8, 1.6, 0.0
    for j in range(V):                             # the row of logits, coloured by owner thread
        ax.add_patch(plt.Rectangle((j, y_in), 0.95, 0.8, color=colors(j % threads), alpha=0.55))
        ax.text(j + 0.47, y_in + 0.4, f"{x[j]:.1f}", ha="center", va="center", fontsize=7)
        ax.text(j + 0.47, y_in + 0.95, str(j), ha="center", va="bottom", fontsize=6, color="0.4")
    ax.text(-0.3, y_in + 0.4, "logits[row, :]\n(read, pass 1)", ha="right", va="center", fontsize=8)
    w = V / threads
    for k, (m, s) in enumerate(pairs):             # one (m, s) pair per thread
        x0 = k * w + 0.1 * w
        ax.add_patch(plt.Rectangle((x0, y_pair), 0.8 * w, 0.8, color=colors(k), alpha=0.3))
        ax.text(x0 + 0.4 * w, y_pair + 0.4, f"thread {k}\nm={m:.1f}  s={s:.2f}", ha="center", va="center",
                fontsize=7)
        for j in range(k, V, threads):
            ax.plot([j + 0.47, x0 + 0.4 * w], [y_in, y_pair + 0.8], color=colors(k), lw=0.5, alpha=0.5)
        ax.plot([x0 + 0.4 * w, V / 2], [y_pair, y_row + 0.8], color="0.4", lw=0.8)
    ax.text(-0.3, y_pair + 0.4, "online softmax\nper thread", ha="right", va="center", fontsize=8)
    ax.add_patch(plt.Rectangle((V / 2 - 2.5, y_row), 5, 0.8, color="0.85"))
    ax.text(V / 2, y_row + 0.4, f"block merge: m = {m_row:.1f}, s = {s_row:.2f}", ha="center", va="center", fontsize=8)
    ax.text(-0.3, y_row + 0.4, f"merge pairs\n(tree: {int(np.log2(threads))} steps)", ha="right", va="center", fontsize=8)
    vmax = float(np.abs(d).max())
    cmap = plt.get_cmap("coolwarm")
    for j in range(V):                             # pass 2: dlogits written directly
        ax.add_patch(plt.Rectangle((j, y_out), 0.95, 0.8, color=cmap(0.5 + 0.5 * d[j] / vmax),
                                   ec="red" if j == target else None, lw=2 if j == target else 0))
        ax.text(j + 0.47, y_out + 0.4, f"{d[j] * 1000:.0f}", ha="center", va="center", fontsize=7)
        ax.plot([j + 0.47, j + 0.47], [y_out + 0.8, y_out + 1.25], color=colors(j % threads), lw=0.6)
    ax.text(-0.3, y_out + 1.05, "owner thread", ha="right", va="center", fontsize=7, color="0.4")
    ax.text(-0.3, y_out + 0.4, "dlogits[row, :] x 1000\n(written, pass 2)", ha="right", va="center", fontsize=8)
    ax.text(target + 0.47, y_out - 0.25, "target", ha="center", va="top", fontsize=7, color="red")
    ax.set_xlim(-3.2, V + 0.2)
    ax.set_ylim(-0.7, y_in + 1.4)
    ax.axis("off")
    ax.set_title(f"one row, V = {V}, one block of {threads} threads (thread k owns logits k, k + {threads}, ...): "
                 f"dlogits_j = (exp(x_j - m) / s - [j = target]) / N, N = {N}\n"
                 f"pass 2 re-reads the logits; the probabilities never get their own (N, V) array", fontsize=9)
    fig.tight_layout()
    return fig


# ---- lesson 03: softmax backward (row reductions) ------------------------------------------------------------

def plot_softmax_mapping(N: int = 6, n: int = 12, threads: int = 4, warp: int = 4, rows_per_block: int = 2):
    """Who owns which element of an (N, n) softmax-backward problem, for the three mappings of lesson 03.

    Left, v1: one thread per row (thread r walks row r). Middle, v2/v3: one block per row (block b owns row b, its
    threads stride the row: thread t takes columns t, t + threads, ...). Right, v4: one warp per row, several rows
    per block (`rows_per_block` warps of `warp` lanes). Cell colour: block; label: threadIdx.x (v4: the lane). Outlined cells: what the first warp reads in
    its first loop step, one load instruction: n elements apart in v1 (uncoalesced), neighbours in v2 and v4
    (coalesced). Drawn with `warp`-lane warps so it fits (a real warp has 32 lanes, 64 on AMD CDNA)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.55 * N + 2.2))
    colors = plt.get_cmap("tab10")
    panels = [
        ("v1: one thread per row", lambda r, j: (r // threads, r % threads),
         lambda r, j: j == 0 and r < warp,
         f"a warp's {warp} threads read column 0 of {warp} rows: addresses n*4 = {4 * n} bytes apart"),
        ("v2 / v3: one block per row", lambda r, j: (r, j % threads),
         lambda r, j: r == 0 and j < min(warp, threads),
         f"thread t takes columns t, t+{threads}, ...: a warp reads {min(warp, threads)} neighbouring floats"),
        (f"v4: one warp per row, {rows_per_block} rows per block", lambda r, j: (r // rows_per_block, j % warp),
         lambda r, j: r == 0 and j < warp,
         f"lane l takes columns l, l+{warp}, ...: a warp reads {warp} neighbouring floats"),
    ]
    for ax, (title, owner, first, caption) in zip(axes, panels):
        for r in range(N):
            for j in range(n):
                b, t = owner(r, j)
                ax.add_patch(plt.Rectangle((j, N - 1 - r), 0.95, 0.9, color=colors(b % 10), alpha=0.55))
                if first(r, j):
                    ax.add_patch(plt.Rectangle((j, N - 1 - r), 0.95, 0.9, fill=False, ec="black", lw=2.2))
                ax.text(j + 0.47, N - 1 - r + 0.45, str(t), ha="center", va="center", fontsize=8)
            ax.text(-0.3, N - 1 - r + 0.45, f"row {r}", ha="right", va="center", fontsize=8)
        ax.set_xlim(-2.2, n + 0.2)
        ax.set_ylim(-1.1, N + 0.1)
        ax.text(n / 2, -0.6, caption, ha="center", va="center", fontsize=8, wrap=True)
        ax.set_title(title, fontsize=10)
        ax.axis("off")
    fig.suptitle(f"softmax backward, N = {N} rows of n = {n}: colour = block, number = threadIdx.x (v4: lane); "
                 f"black outline = the first warp's first load", fontsize=10)
    fig.tight_layout()
    return fig


def plot_block_reduction(threads: int = 8):
    """How a block adds its threads' partial sums: v2's shared-memory tree (left: at stride s, thread t < s adds
    partial[t + s]; a __syncthreads() between steps) beside a warp's xor-shuffle butterfly (right: every lane adds
    lane ^ offset's value; no shared memory, no barrier, and every lane ends with the total)."""
    plt = _pyplot()
    steps = max(int(threads).bit_length() - 1, 1)
    fig, axes = plt.subplots(1, 2, figsize=(14, 7 * (steps + 1.6) / (threads + 7.5) + 0.9))
    for ax, kind in zip(axes, ("tree", "shuffle")):
        active = threads
        for level in range(steps + 1):
            y = -level
            for t in range(threads):
                live = (t < active) if kind == "tree" else True
                ax.add_patch(plt.Circle((t, y), 0.28, color="tab:blue" if live else "lightgray", alpha=0.8))
                if level == 0:
                    ax.text(t, y + 0.45, str(t), ha="center", fontsize=8)
            if level == 0:
                ax.text(-0.6, y + 0.45, "thread" if kind == "tree" else "lane", ha="right", fontsize=8)
            if level == steps:
                break
            offset = threads >> (level + 1)
            for t in range(threads):
                if kind == "tree":
                    if t < offset:
                        ax.annotate("", (t, y - 1 + 0.3), (t + offset, y - 0.3),
                                    arrowprops=dict(arrowstyle="->", color="tab:orange", lw=1.2))
                        ax.plot([t, t], [y - 0.3, y - 1 + 0.3], color="tab:blue", lw=1)
                else:
                    ax.annotate("", (t, y - 1 + 0.3), (t ^ offset, y - 0.3),
                                arrowprops=dict(arrowstyle="->", color="tab:green", lw=0.9, alpha=0.8))
            note = (f"stride {offset}: t < {offset} adds partial[t + {offset}]; __syncthreads()" if kind == "tree"
                    else f"offset {offset}: v += shfl_xor(v, {offset})")
            ax.text(threads - 0.2, y - 0.5, note, va="center", fontsize=8)
            active = offset
        ax.set_xlim(-2.0, threads + 5.5)
        ax.set_ylim(-steps - 0.6, 0.9)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title("v2: tree in shared memory (the total ends in partial[0])" if kind == "tree" else
                     "v3 / v4: warp shuffle butterfly (every lane ends with the total)", fontsize=10)
    fig.suptitle(f"adding {threads} partial sums in log2({threads}) = {steps} steps", fontsize=10)
    fig.tight_layout()
    return fig


def plot_version_fractions(result: dict, target: Optional[float] = None, ax=None):
    """One bar per benchmarked row of `result` (bench.kernel_results): fraction of its ceiling (copy bandwidth for
    memory-bound ops), labelled backend + version, with an optional target line (e.g. 0.7)."""
    plt = _pyplot()
    rows = [r for r in result["rows"] if "error" not in r]
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.6))
    else:
        fig = ax.figure
    colors = {"numba": "tab:blue", "hip": "tab:orange", "torch": "tab:red"}
    labels = [f"{r['op']} {r['backend']} {r['version']}" for r in rows]
    fracs = [100 * r["fraction_of_ceiling"] for r in rows]
    ax.barh(range(len(rows)), fracs, color=[colors.get(r["backend"], "gray") for r in rows])
    for i, r in enumerate(rows):
        ax.text(fracs[i] + 1, i, f"{r['GB/s']:.0f} GB/s, {r['ms'] * 1e3:.0f} us", va="center", fontsize=8)
    if target is not None:
        ax.axvline(100 * target, color="black", ls="--", lw=1)
        ax.text(100 * target, len(rows) - 0.4, f" target {100 * target:.0f}%", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 115)
    ax.set_xlabel("% of the measured ceiling (copy bandwidth for memory-bound ops)")
    ax.set_title(f"{result['card']} ({result['date']})", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


# ---- lesson 02: linear backward (tiled GEMM, bias-gradient column sum) --------------------------------------------

def plot_tiled_gemm(M: int = 12, P: int = 16, K: int = 12, tile: int = 4, block=(2, 1), step: int = 1,
                    thread=(2, 1), ax=None):
    """The tiled GEMM out (M, P) = op(A) (M, K) @ op(B) (K, P) of lesson 02 (kernels/numba/linear.py, v2), drawn
    in the classic layout: op(A) left of out, op(B) above it, so a row of A lines up with its row of out and a
    column of B with its column. block = (bx, by) owns the orange tile of out (tile x tile elements, one per thread);
    it walks along K in steps of `tile`: at step `step` it copies the dark tile of A and the dark tile of B into
    shared memory (one element per thread each), syncs, and every thread reads a row of the A tile and a column of
    the B tile from there. Each element copied is used by `tile` threads. thread = (tx, ty) marks one thread's
    element of out and the shared-memory row and column it reads."""
    plt = _pyplot()
    bx, by = block
    tx, ty = thread
    steps = (K + tile - 1) // tile
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 8.2))
    else:
        fig = ax.figure
    gap = 1.5
    i0, j0, k0 = by * tile, bx * tile, step * tile

    def cell(x, y, **kw):
        ax.add_patch(plt.Rectangle((x, y), 1, 1, lw=0.4, ec="0.7", **kw))

    # op(A): columns k at x = k - K - gap, rows i at y = i
    for i in range(M):
        for k in range(K):
            in_strip = i0 <= i < i0 + tile
            now = in_strip and k0 <= k < k0 + tile
            done = in_strip and k < k0
            color = "tab:blue" if now else ("#cfe0f3" if in_strip else "white")
            cell(k - K - gap, i, fc=color, alpha=0.85 if now else 1.0, hatch="///" if done else None)
    # op(B): columns j at x = j, rows k at y = k - K - gap
    for k in range(K):
        for j in range(P):
            in_strip = j0 <= j < j0 + tile
            now = in_strip and k0 <= k < k0 + tile
            done = in_strip and k < k0
            color = "tab:green" if now else ("#d5ecd5" if in_strip else "white")
            cell(j, k - K - gap, fc=color, alpha=0.85 if now else 1.0, hatch="///" if done else None)
    # out: one tile per block (tile grid drawn thicker)
    for i in range(M):
        for j in range(P):
            mine = i0 <= i < i0 + tile and j0 <= j < j0 + tile
            cell(j, i, fc="tab:orange" if mine else "white", alpha=0.6 if mine else 1.0)
    for r in range(0, M + 1, tile):
        ax.plot([0, P], [r, r], color="0.3", lw=1.2)
    for c in range(0, P + 1, tile):
        ax.plot([c, c], [0, M], color="0.3", lw=1.2)
    for by_ in range((M + tile - 1) // tile):
        for bx_ in range((P + tile - 1) // tile):
            ax.text(bx_ * tile + tile / 2, by_ * tile + tile / 2, f"block\n({bx_}, {by_})", ha="center",
                    va="center", fontsize=7, color="0.25" if (bx_, by_) != (bx, by) else "black",
                    weight="bold" if (bx_, by_) == (bx, by) else None)
    # one thread: its element of out, the row of the A tile and the column of the B tile it reads
    i, j = i0 + ty, j0 + tx
    ax.add_patch(plt.Rectangle((j, i), 1, 1, fill=False, ec="red", lw=2.2))
    ax.add_patch(plt.Rectangle((k0 - K - gap, i), tile, 1, fill=False, ec="red", lw=2.2))
    ax.add_patch(plt.Rectangle((j, k0 - K - gap), 1, tile, fill=False, ec="red", lw=2.2))
    ax.annotate(f"thread (tx={tx}, ty={ty}) owns out[{i}, {j}]", (j + 1, i + 0.5), (P + 0.6, i0 + tile + 1.5),
                fontsize=8, color="red", arrowprops=dict(arrowstyle="->", color="red", lw=1))
    # labels
    ax.text(-K / 2 - gap, -0.6, "op(A)  (M, K)", ha="center", fontsize=10)
    ax.text(P / 2, -K - gap - 0.6, "op(B)  (K, P)", ha="center", fontsize=10)
    ax.text(P / 2, M + 0.9, "out  (M, P)", ha="center", fontsize=10)
    ax.text(-K - gap - 0.4, i0 + tile / 2, f"rows {i0}..{i0 + tile - 1}\n(block row by = {by})", ha="right",
            va="center", fontsize=8)
    ax.text(j0 + tile / 2, -K - gap - 1.7, f"columns {j0}..{j0 + tile - 1} (bx = {bx})", ha="center", fontsize=8)
    note = (f"block ({bx}, {by}) walks K in {steps} steps of TILE = {tile}.  Step {step} (k = {k0}..{k0 + tile - 1}): "
            f"its {tile * tile} threads copy the dark {tile}x{tile} tile of op(A) and of op(B)\n"
            f"into shared memory (one element each), syncthreads(), then each thread adds {tile} products "
            f"sa[ty, kk] * sb[kk, tx]; syncthreads() again before the next step.\n"
            f"Hatched: steps already done. Every element copied is read by {tile} threads: "
            f"global-memory loads drop {tile}x compared with v1 (real TILE = 16: 16x).")
    ax.text(-K - gap, M + 2.2, note, fontsize=8.5, va="top")
    ax.text(k0 - K - gap + tile / 2, i0 - 0.25, "-> sa (shared)", ha="center", va="bottom", fontsize=8,
            color="tab:blue", weight="bold")
    ax.text(j0 + tile + 0.3, k0 - K - gap + tile / 2, "-> sb (shared)", ha="left", va="center", fontsize=8,
            color="tab:green", weight="bold")
    ax.set_xlim(-K - gap - 6.5, P + 7.5)
    ax.set_ylim(M + 5.2, -K - gap - 2.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"tiled GEMM (v2): out = op(A) @ op(B), M = {M}, P = {P}, K = {K}, TILE = {tile} "
                 f"(one block = TILE x TILE threads = one tile of out)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_dbias_columns(N: int = 6, OC: int = 12, threads: int = 4, warp: int = 4, ax=None):
    """dbias = dout.sum(axis=0), one thread per output column o (kernels/numba/linear.py dbias_v1): thread o walks
    down column o adding the N rows. Colour: block; label: threadIdx.x. In loop step n the threads of a warp read
    row n's neighbouring columns together (outlined: one load instruction, coalesced)."""
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(0.75 * OC + 3, 15), 0.55 * N + 2.6))
    else:
        fig = ax.figure
    colors = plt.get_cmap("tab10")
    for n in range(N):
        for o in range(OC):
            b, t = divmod(o, threads)
            ax.add_patch(plt.Rectangle((o, n), 0.95, 0.9, color=colors(b % 10), alpha=0.45))
            ax.text(o + 0.47, n + 0.45, f"t{t}" if n == 0 else "", ha="center", va="center", fontsize=7)
        ax.text(-0.3, n + 0.45, f"n = {n}", ha="right", va="center", fontsize=8)
    ax.add_patch(plt.Rectangle((0, 0), min(warp, OC) - 0.05, 0.9, fill=False, ec="black", lw=2.2))
    for o in range(OC):
        ax.annotate("", (o + 0.47, N + 0.55), (o + 0.47, 0.75),
                    arrowprops=dict(arrowstyle="->", color=colors((o // threads) % 10), lw=1, alpha=0.8))
        ax.add_patch(plt.Rectangle((o, N + 0.6), 0.95, 0.9, color=colors((o // threads) % 10), alpha=0.85))
        ax.text(o + 0.47, N + 1.05, str(o), ha="center", va="center", fontsize=7, color="white")
    ax.text(-0.3, N + 1.05, "dbias[o]", ha="right", va="center", fontsize=8)
    ax.text(OC / 2, -0.5, f"dout (N = {N}, OC = {OC}); colour = block of {threads} threads, t = threadIdx.x",
            ha="center", fontsize=9)
    ax.text(OC / 2, N + 2.1, f"thread o adds dout[0, o] + dout[1, o] + ... + dout[{N - 1}, o] (a loop over rows, "
            f"no communication between threads).\nBlack outline: what one warp of {warp} threads reads in loop step "
            f"n = 0, neighbouring addresses = one coalesced load.", ha="center", va="top", fontsize=8)
    ax.set_xlim(-1.6, OC + 0.2)
    ax.set_ylim(N + 3.2, -1.0)
    ax.axis("off")
    ax.set_title("bias gradient: a column reduction, one thread per output channel", fontsize=10)
    fig.tight_layout()
    return fig


def plot_linear_rates(result: dict, ax=None):
    """Bars of achieved TFLOP/s for each linear_backward row of a kernel benchmark (bench.kernel_results), with the
    fp32 matmul ceiling measured in the same run as a dashed line; labels give ms and % of that ceiling."""
    plt = _pyplot()
    rows = [r for r in result["rows"] if r["op"] == "linear" and "error" not in r]
    if ax is None:
        fig, ax = plt.subplots(figsize=(8.5, 0.42 * len(rows) + 1.8))
    else:
        fig = ax.figure
    peak = result["ceilings"]["matmul_fp32"]["TFLOP/s"]
    colors = {"numba": "tab:blue", "hip": "tab:orange", "torch": "tab:red"}
    ax.barh(range(len(rows)), [r["TFLOP/s"] for r in rows], color=[colors.get(r["backend"], "gray") for r in rows])
    for k, r in enumerate(rows):
        ax.text(r["TFLOP/s"] + 0.01 * peak, k, f"{r['ms']:.2f} ms, {100 * r['TFLOP/s'] / peak:.0f}%",
                va="center", fontsize=8)
    ax.axvline(peak, color="black", ls="--", lw=1)
    ax.set_yticks(range(len(rows)), [f"{r['backend']} {r['version']}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * peak)
    ax.set_xlabel("achieved TFLOP/s (4 N C OC + N OC flops per call)")
    shape = rows[0]["shape"] if rows else ""
    ax.set_title(f"linear backward {shape} on {result['card']} ({result['date']})\n"
                 f"dashed: the fp32 matmul ceiling measured in the same run, {peak:.1f} TFLOP/s", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


# ---- lesson 04: LayerNorm backward ------------------------------------------------------------------------------

def plot_layernorm_dinp_mapping(N: int = 4, C: int = 12, threads: int = 4, ax=None):
    """LayerNorm backward dinp, one block per row (kernels v2/v3): each cell of the (N, C) array is labelled with the
    thread that owns it (thread t: channels t, t + blockDim.x, ...), coloured by its block (= its row). Below: the
    shared-memory tree that turns the block's per-thread partial sums of g and g*xhat into the two row means."""
    plt = _pyplot()
    if ax is None:
        fig, (ax, ax_tree) = plt.subplots(2, 1, figsize=(min(0.55 * C + 6, 16), 0.5 * N + 3.2),
                                          gridspec_kw={"height_ratios": [N + 1.2, 3.2]})
    else:
        fig, ax_tree = ax.figure, None
    colors = plt.get_cmap("tab10")
    for row in range(N):
        y = N - 1 - row
        for c in range(C):
            ax.add_patch(plt.Rectangle((c, y), 0.95, 0.9, color=colors(row % 10), alpha=0.65))
            ax.text(c + 0.47, y + 0.45, f"t{c % threads}", ha="center", va="center", fontsize=7)
        ax.text(-0.3, y + 0.45, f"block {row}\n(row {row})", ha="right", va="center", fontsize=8)
        ax.annotate("", xy=(C + 1.2, y + 0.45), xytext=(C + 0.1, y + 0.45),
                    arrowprops=dict(arrowstyle="->", color="gray"))
        ax.text(C + 1.3, y + 0.45, "sum g, sum g*xhat (tree) -> mean(g), mean(g*xhat) -> write dinp[row, :]",
                va="center", fontsize=7.5)
    for c in range(C):
        ax.text(c + 0.47, N + 0.1, str(c), ha="center", va="bottom", fontsize=7, color="gray")
    ax.text(C / 2, N + 0.65, f"channel c  (thread t owns c = t, t + {threads}, ...: neighbouring threads read "
            f"neighbouring addresses)", ha="center", fontsize=8, color="gray")
    ax.set_xlim(-2.4, C + 13)
    ax.set_ylim(-0.3, N + 1.2)
    ax.axis("off")
    ax.set_title(f"dinp: one block of {threads} threads per row, N = {N} rows, C = {C} channels", fontsize=10)
    if ax_tree is not None:
        # tree for one block: level 0 = per-thread partial sums, each level the lower half adds the upper half
        u = C / threads                                    # the tree spans the row's width
        levels = []
        n = threads
        while n >= 1:
            levels.append(n)
            n //= 2
        for li, n in enumerate(levels):
            y = len(levels) - 1 - li
            for t in range(n):
                ax_tree.add_patch(plt.Rectangle((t * u, y), 0.9 * u, 0.7, color=colors(0), alpha=0.35 + 0.15 * li))
                label = f"t{t}: own sum" if li == 0 else (f"t{t}" if n > 1 else "total (buf[0])")
                ax_tree.text(t * u + 0.45 * u, y + 0.35, label, ha="center", va="center", fontsize=7)
                if li > 0:
                    for src in (t, t + n):
                        ax_tree.plot([src * u + 0.45 * u, t * u + 0.45 * u], [y + 1.0, y + 0.7], color="gray", lw=0.8)
            ax_tree.text(-0.3, y + 0.35, "partials" if li == 0 else f"stride {n}", ha="right", va="center",
                         fontsize=7.5)
        ax_tree.text(C + 0.5, len(levels) / 2,
                     f"block 0's tree in shared memory: {len(levels) - 1} steps of (buf[t] += buf[t + stride]; "
                     f"syncthreads)\ndone twice side by side (g and g*xhat); v3 does the same sums with warp shuffles",
                     va="center", fontsize=8)
        ax_tree.set_xlim(-2.4, C + 13)
        ax_tree.set_ylim(-0.2, len(levels) + 0.1)
        ax_tree.axis("off")
    fig.tight_layout()
    return fig


def plot_column_reduction(N: int = 12, C: int = 8, threads: int = 4, rows_per_chunk: int = 4, ax=None):
    """dweight/dbias by the two-stage column reduction (kernels v2_partials + v2_reduce): block (bx, by) owns a
    column block and a chunk of rows; each thread sums its column over the chunk into the partials (n_chunks, C);
    then one thread per column adds the n_chunks partials, always in the same order (deterministic)."""
    plt = _pyplot()
    n_chunks = (N + rows_per_chunk - 1) // rows_per_chunk
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(1.6 * C + 6, 17), 0.42 * N + 2.2))
    else:
        fig = ax.figure
    colors = plt.get_cmap("tab10")
    # the (N, C) inputs dout and xhat, coloured by chunk
    for row in range(N):
        k = row // rows_per_chunk
        y = N - 1 - row
        for c in range(C):
            ax.add_patch(plt.Rectangle((c, y), 0.95, 0.9, color=colors(k % 10), alpha=0.55))
            if row % rows_per_chunk == 0:
                ax.text(c + 0.47, y + 0.45, f"t{c % threads}", ha="center", va="center", fontsize=6.5)
    for cb in range(1, (C + threads - 1) // threads):
        ax.plot([cb * threads - 0.03] * 2, [-0.2, N + 0.1], color="black", lw=1.5)
    if n_chunks > 1 and C > threads:                      # outline one block: column block 1, chunk 1
        y_lo = N - min(N, 2 * rows_per_chunk)
        ax.add_patch(plt.Rectangle((threads - 0.05, y_lo - 0.05), min(threads, C - threads) + 0.05,
                                   min(N, 2 * rows_per_chunk) - rows_per_chunk + 0.05, fill=False, lw=2.2,
                                   edgecolor="black", ls="--"))
        ax.text(threads + min(threads, C - threads) / 2, y_lo + 0.45, "block (1, 1)", ha="center", va="center",
                fontsize=8, fontweight="bold")
    for k in range(n_chunks):
        y_mid = N - (k * rows_per_chunk + min(N, (k + 1) * rows_per_chunk)) / 2
        ax.text(-0.3, y_mid, f"chunk {k}\n(blockIdx.y = {k})", ha="right", va="center", fontsize=7.5)
    ax.text(C / 2, N + 0.35, "dout, xhat (N, C): column blocks (blockIdx.x) split by black lines", ha="center",
            fontsize=8)
    # stage 1 -> partials (n_chunks, C)
    x0 = C + 3
    top = N - 1 - (N - n_chunks) / 2
    for k in range(n_chunks):
        y = top - k
        for c in range(C):
            ax.add_patch(plt.Rectangle((x0 + c, y), 0.95, 0.9, color=colors(k % 10), alpha=0.85))
        ax.text(x0 + C + 0.2, y + 0.45, f"partial[{k}, :]", va="center", fontsize=7)
    ax.annotate("", xy=(x0 - 0.3, N / 2), xytext=(C + 0.3, N / 2), arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.text((C + x0) / 2 - 0.2, N / 2 + 0.6, "stage 1\neach thread: its\ncolumn over\none chunk", ha="center",
            va="bottom", fontsize=7.5)
    ax.text(x0 + C / 2, top + 1.3, f"partials (n_chunks = {n_chunks}, C)", ha="center", fontsize=8)
    # stage 2 -> (C,)
    x1 = x0 + C + 5
    y = N / 2 - 0.45
    for c in range(C):
        ax.add_patch(plt.Rectangle((x1 + c, y), 0.95, 0.9, color="dimgray", alpha=0.8))
        ax.text(x1 + c + 0.47, y + 0.45, f"c{c}", ha="center", va="center", fontsize=6.5, color="white")
    ax.annotate("", xy=(x1 - 0.3, N / 2), xytext=(x0 + C + 2.2, N / 2), arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.text(x0 + C + 2.7, N / 2 - 0.9, "stage 2\none thread per\ncolumn, chunks\nin order", ha="center", va="top",
            fontsize=7.5)
    ax.text(x1 + C / 2, y + 1.3, "dweight, dbias (C,)", ha="center", fontsize=8)
    ax.set_xlim(-3.2, x1 + C + 0.5)
    ax.set_ylim(-0.4, N + 1.0)
    ax.axis("off")
    ax.set_title(f"dweight, dbias: two-stage column reduction (N = {N}, C = {C}, {threads} threads per block, "
                 f"{rows_per_chunk} rows per chunk)", fontsize=10)
    fig.tight_layout()
    return fig


# ---- lesson 06: fused AdamW over the flat parameter buffer --------------------------------------------------------
ADAMW_TRAFFIC = {   # bytes per fp32 parameter, (buffer, "r"/"w", bytes) per kernel, as kernels/numba/adamw.py counts
    "v1 unfused (5 kernels)": [("decay", [("p", "r"), ("g", "r"), ("p", "w"), ("g", "w")]),
                               ("m", [("m", "r"), ("g", "r"), ("m", "w")]),
                               ("v", [("v", "r"), ("g", "r"), ("v", "w")]),
                               ("update", [("p", "r"), ("m", "r"), ("v", "r"), ("p", "w")]),
                               ("zero", [("g", "w")])],
    "v2 fused (1 kernel)": [("fused", [("p", "r"), ("g", "r"), ("m", "r"), ("v", "r"),
                                       ("p", "w"), ("m", "w"), ("v", "w"), ("g", "w")])],
    "PyTorch fused + zero_grad": [("fused", [("p", "r"), ("g", "r"), ("m", "r"), ("v", "r"),
                                             ("p", "w"), ("m", "w"), ("v", "w")]),
                                  ("zero_grad", [("g", "w")])],
}


def plot_param_buffer(param_buffer, decay_names=None, ax=None):
    """The flat parameter buffer (params.ParamBuffer) and its decay table: top, the buffer to scale (one segment per
    named view, green where the tensor decays); below, one box per tensor (equal widths, in buffer order) with its
    name, shape, [start, stop) and its flag: the (bounds, flags) table the fused AdamW kernel reads."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    if decay_names is None:
        from .optim import DECAY_NAMES as decay_names
    names = list(param_buffer.names)
    n = int(param_buffer.flat.size)
    k = len(names)
    if ax is None:
        fig, ax = plt.subplots(figsize=(15, 4.4))
    else:
        fig = ax.figure
    col = {True: "tab:green", False: "tab:gray"}
    W = float(k)                                   # the top bar spans the same width as the k boxes
    for name in names:
        a, b = param_buffer.offsets[name]
        ax.add_patch(plt.Rectangle((W * a / n, 3.0), W * (b - a) / n, 0.8, facecolor=col[name in decay_names],
                                   edgecolor="white", lw=0.5, alpha=0.85))
        if (b - a) / n > 0.06:
            ax.text(W * (a + b) / 2 / n, 3.4, name, ha="center", va="center", fontsize=8, color="white")
    ax.text(0, 3.95, f"params.flat: {n:,} float32 in one buffer (to scale)", fontsize=9)
    for j, name in enumerate(names):
        a, b = param_buffer.offsets[name]
        decays = name in decay_names
        ax.add_patch(plt.Rectangle((j + 0.03, 0.0), 0.94, 2.0, facecolor=col[decays], alpha=0.5 if decays else 0.3,
                                   edgecolor="black", lw=0.5))
        shape = "x".join(str(s) for s in param_buffer.shapes[name])
        ax.text(j + 0.5, 1.65, name, ha="center", fontsize=8, weight="bold")
        ax.text(j + 0.5, 1.25, f"({shape})", ha="center", fontsize=6.5)
        ax.text(j + 0.5, 0.85, f"[{a:,},", ha="center", fontsize=6.5)
        ax.text(j + 0.5, 0.55, f"{b:,})", ha="center", fontsize=6.5)
        ax.text(j + 0.5, 0.15, f"flag {int(decays)}", ha="center", fontsize=7.5)
        ax.plot([j + 0.5, W * (a + b) / 2 / n], [2.02, 2.98], color="black", lw=0.4, alpha=0.5)
    ax.legend(handles=[Patch(color="tab:green", label="decays (flag 1): wte, wpe and the weight matrices"),
                       Patch(color="tab:gray", label="no decay (flag 0): biases, LayerNorm weights and biases")],
              loc="lower center", bbox_to_anchor=(0.5, -0.12), fontsize=8, ncol=2, frameon=False)
    ax.set_xlim(-0.1, W + 0.1)
    ax.set_ylim(-0.2, 4.3)
    ax.axis("off")
    ax.set_title("one flat buffer, named views, and the decay table (bounds = the [start, stop) edges, flags)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_adamw_bytes(copy_gbps: Optional[float] = None, n_params: int = 124_000_000, ax=None):
    """Bytes moved per fp32 parameter by each AdamW version (stacked: one segment per 4-byte read or write, one
    colour per buffer p, g, m, v; hatched = write; a gap between kernels), and, with copy_gbps, the predicted time
    for n_params at that bandwidth."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 3.0))
    else:
        fig = ax.figure
    colors = {"p": "tab:blue", "g": "tab:orange", "m": "tab:green", "v": "tab:purple"}
    labels = list(ADAMW_TRAFFIC)
    for row, label in enumerate(labels):
        x = 0.0
        for kernel, accesses in ADAMW_TRAFFIC[label]:
            x0 = x
            for buf, rw in accesses:
                ax.barh(row, 4, left=x, height=0.6, color=colors[buf], edgecolor="white",
                        hatch="//" if rw == "w" else None, alpha=0.85)
                ax.text(x + 2, row, f"{rw} {buf}", ha="center", va="center", fontsize=7, color="white")
                x += 4
            ax.text((x0 + x) / 2, row - 0.33, kernel, ha="center", va="bottom", fontsize=7)
            x += 0.8                                  # the gap: a kernel boundary, everything goes back to HBM
        total = 4 * sum(len(a) for _, a in ADAMW_TRAFFIC[label])
        note = f"{total} B/param"
        if copy_gbps:
            note += (f" -> {total * n_params / (copy_gbps * 1e9) * 1e3:.2f} ms for {n_params / 1e6:.0f}M "
                     f"at {copy_gbps:.0f} GB/s")
        ax.text(x + 0.5, row, note, va="center", fontsize=8)
    handles = [Patch(color=c, label=b) for b, c in colors.items()]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="write"))
    ax.legend(handles=handles, fontsize=7, ncol=5, loc="lower right")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlim(0, 100)
    ax.set_ylim(len(labels) - 0.3, -0.75)
    ax.set_xlabel("bytes per parameter (read r / write w, 4 bytes each)")
    ax.set_title("AdamW: bytes moved per fp32 parameter", fontsize=10)
    fig.tight_layout()
    return fig


def plot_activation_timeline(timelines: dict, title: str = "", ax=None):
    """Live activation memory through one forward + backward, one line per policy.

    timelines: {policy: [(label, bytes), ...]} as checkpointing.activation_timeline returns (the same points for
    every policy). The forward grows the memory block by block, the backward frees it block by block (the
    sawtooth); "full" keeps only each block's input plus, briefly, one block's recomputed cache."""
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 3.8))
    else:
        fig = ax.figure
    colors = {"none": "tab:red", "selective": "tab:orange", "full": "tab:green"}
    labels = None
    for policy, points in timelines.items():
        labels = [lab for lab, _ in points]
        mib = [b / 2**20 for _, b in points]
        ax.step(range(len(points)), mib, where="post", lw=2, color=colors.get(policy), label=policy)
        peak = max(range(len(mib)), key=mib.__getitem__)
        ax.annotate(f"peak {mib[peak]:.1f} MiB", (peak, mib[peak]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8, color=colors.get(policy))
    turn = labels.index("head + loss")
    ax.axvspan(-0.5, turn + 0.5, color="tab:blue", alpha=0.05)
    ax.text(turn / 2, ax.get_ylim()[1] * 0.97, "forward", ha="center", va="top", fontsize=9, color="tab:blue")
    ax.text((turn + len(labels)) / 2, ax.get_ylim()[1] * 0.97, "backward", ha="center", va="top", fontsize=9)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_ylabel("live activations (MiB)")
    ax.set_title(title or "activation memory during one training step", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    return fig


def plot_checkpoint_tradeoff(sources: dict, claim=(0.5, (1.3, 1.4)), ax=None):
    """Memory vs compute of the checkpointing policies: x = step time relative to policy "none", y = activation
    bytes relative to "none", one marker per policy, one colour per source.

    sources: {name: {policy: (memory_rel, time_rel)}} (checkpointing.tradeoff_points gives this per group).
    claim: (memory_rel, (time_lo, time_hi)) drawn as a shaded box, the claim being tested (about half the memory
    for 30-40% more compute); None for no box."""
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4.2))
    else:
        fig = ax.figure
    markers = {"none": "o", "selective": "s", "full": "^"}
    cmap = plt.get_cmap("tab10")
    if claim is not None:
        mem, (lo, hi) = claim
        ax.add_patch(plt.Rectangle((lo, mem - 0.1), hi - lo, 0.2, color="gray", alpha=0.2))
        ax.text(lo, mem + 0.11, f"claim: ~{mem:.0%} memory for +{lo - 1:.0%}..{hi - 1:.0%} time", fontsize=8,
                color="dimgray")
    for k, (name, points) in enumerate(sources.items()):
        for policy, (mem_rel, time_rel) in points.items():
            ax.scatter(time_rel, mem_rel, marker=markers.get(policy, "x"), s=60, color=cmap(k % 10),
                       label=name if policy == "none" else None, zorder=3)
            ax.annotate(policy, (time_rel, mem_rel), textcoords="offset points", xytext=(5, -3), fontsize=7)
    for policy, m in markers.items():
        ax.scatter([], [], marker=m, color="gray", label=policy)
    ax.set_xlabel("step time relative to no checkpointing")
    ax.set_ylabel("activation memory relative to none")
    ax.set_ylim(0, 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("activation checkpointing: memory saved vs time paid", fontsize=10)
    fig.tight_layout()
    return fig


# ---- lesson 07: mixed precision ------------------------------------------------------------------------------------

def plot_float_formats(ax=None):
    """The bit layouts of fp32, TF32, fp16 and bf16 (sign, exponent, mantissa boxes, one per bit) with each format's
    largest value, smallest normal and subnormal, and machine epsilon. TF32 is what tensor cores read of an fp32
    input in an fp32 matmul (cuBLAS's TF32 mode): fp32's sign and 8 exponent bits and the top 10 mantissa bits."""
    plt = _pyplot()
    from matplotlib.patches import Patch, Rectangle
    fmts = [("fp32", 8, 23), ("tf32", 8, 10), ("fp16", 5, 10), ("bf16", 8, 7)]
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 4.0))
    else:
        fig = ax.figure
    colors = {"sign": "tab:red", "exponent": "tab:green", "mantissa": "tab:blue"}
    for row, (name, e, m) in enumerate(fmts):
        y = -row * 1.2
        kinds = ["sign"] + ["exponent"] * e + ["mantissa"] * m
        for i, kind in enumerate(kinds):
            ax.add_patch(Rectangle((i, y), 0.92, 0.8, color=colors[kind], alpha=0.75))
        if name == "tf32":   # the 13 low bits of the fp32 word that the tensor core ignores
            for i in range(len(kinds), 32):
                ax.add_patch(Rectangle((i, y), 0.92, 0.8, facecolor="none", edgecolor="0.5", ls=":"))
        bias = 2 ** (e - 1) - 1
        largest = (2 - 2.0 ** -m) * 2.0 ** bias
        info = (f"{name}: 1 + {e} + {m} bits | max {largest:.4g} | min normal 2^{1 - bias} = {2.0 ** (1 - bias):.2g} | "
                f"min subnormal 2^{1 - bias - m} = {2.0 ** (1 - bias - m):.2g} | eps 2^-{m} = {2.0 ** -m:.2g}")
        ax.text(0, y + 0.88, info, fontsize=8.5, va="bottom")
    handles = [Patch(color=c, alpha=0.75, label=k) for k, c in colors.items()]
    handles.append(Patch(facecolor="none", edgecolor="0.5", ls=":", label="tf32: the fp32 bits a tensor core ignores"))
    ax.legend(handles=handles, loc="lower right", fontsize=8, ncol=4)
    ax.set_xlim(-0.5, 33)
    ax.set_ylim(-(len(fmts) - 1) * 1.2 - 0.9, 1.4)
    ax.axis("off")
    ax.set_title("bf16 keeps fp32's 8 exponent bits (its range), fp16 keeps more mantissa (its precision); TF32, "
                 "what tensor cores read of fp32 in an fp32 matmul, has both", fontsize=10)
    fig.tight_layout()
    return fig


def float_formats_html(value: float) -> str:
    """An HTML table of how `value` is stored in fp32, fp16, bf16 (precision.format_rows) and TF32: one column
    each for the sign, exponent and mantissa bits (monospace, so the bits line up), the hex word, the value the
    format holds and the relative error."""
    import html

    from .precision import format_rows, tf32_row
    rows = format_rows(value) + [tf32_row(value)]
    mono = "font-family: var(--jp-code-font-family, monospace); white-space: pre;"
    cell = f"padding: 1px 8px; text-align: left; {mono}"
    head = "".join(f'<th style="padding: 1px 8px; text-align: {a}">{h}</th>' for h, a in (
        ("format", "left"), ("sign", "left"), ("exponent", "left"), ("mantissa", "left"), ("hex", "left"),
        ("stored value", "right"), ("rel. error", "right")))
    body = []
    for r in rows:
        sign, exponent, mantissa = r["bits"].split()
        tds = [(r["name"], "left"), (sign, "left"), (exponent, "left"), (mantissa, "left"), (r["hex"], "left"),
               (f"{r['stored']:.10g}", "right"), (f"{r['rel_err']:.2e}", "right")]
        body.append("<tr>" + "".join(f'<td style="{cell} text-align: {a}">{html.escape(t)}</td>' for t, a in tds)
                    + "</tr>")
    return (f'<div style="{mono}">value {html.escape(repr(float(value)))}</div>'
            f'<table style="border-collapse: collapse"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


def float_formats_widget(value: float = 0.1):
    """An ipywidgets box: type a value, or move the slider (log10 of |value|), and see its fp32, fp16, bf16 and
    TF32 bits, the value each format stores and the relative error (float_formats_html). The text box and the
    slider follow each other. Needs a widget frontend."""
    import math

    import ipywidgets as widgets

    lo, hi, step = -9.0, 6.0, 0.05
    box = widgets.FloatText(value=value, description="value", step=0.1)
    exp = widgets.FloatSlider(value=0.0, min=lo, max=hi, step=step, description="or 10^",
                              continuous_update=True, readout_format=".2f")
    out = widgets.HTML()
    syncing = []                     # non-empty while one control sets the other: no echo back

    def show(*_):
        out.value = float_formats_html(box.value)

    def to_slider(value):
        if value != 0 and math.isfinite(value):
            exp.value = min(hi, max(lo, round(math.log10(abs(value)) / step) * step))

    def from_box(change):
        show()
        if not syncing:
            syncing.append(1)
            try:
                to_slider(change["new"])
            finally:
                syncing.clear()

    def from_slider(change):
        if syncing:
            return
        syncing.append(1)
        try:
            sign = -1.0 if box.value < 0 else 1.0
            box.value = sign * float(f"{10.0 ** change['new']:.6g}")
        finally:
            syncing.clear()

    box.observe(from_box, names="value")
    exp.observe(from_slider, names="value")
    syncing.append(1)                # the slider starts at the value's log10, the value itself stays as given
    to_slider(value)
    syncing.clear()
    show()
    return widgets.VBox([widgets.HBox([box, exp]), out])


def plot_grad_histogram(grads, scale: float = 2.0 ** 16, ax=None):
    """Histogram of log2|g| of a gradient (nonzero elements), unscaled and multiplied by `scale`, with the fp16
    limits marked: 2^-24 (smallest subnormal: below about half of it a value rounds to 0), 2^-14 (smallest
    normal: below it precision drops), 65504 (largest: above it inf). The legend gives the fraction of the nonzero
    elements that round to 0 in fp16, without and with the scale."""
    import numpy as np
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 3.8))
    else:
        fig = ax.figure
    g = np.asarray(grads, dtype=np.float32).ravel()
    g = g[g != 0]
    with np.errstate(over="ignore"):
        flushed = float(np.mean(g.astype(np.float16) == 0))
        flushed_s = float(np.mean((g * np.float32(scale)).astype(np.float16) == 0))
        over_s = float(np.mean(~np.isfinite((g * np.float32(scale)).astype(np.float16))))
    lg = np.log2(np.abs(g).astype(np.float64))
    bins = np.arange(np.floor(lg.min()) - 1, np.ceil(lg.max() + np.log2(scale)) + 2, 0.5)
    ax.hist(lg, bins=bins, alpha=0.6, color="tab:blue",
            label=f"g (unscaled): {100 * flushed:.2f}% round to 0 in fp16")
    ax.hist(lg + np.log2(scale), bins=bins, alpha=0.5, color="tab:orange",
            label=f"g x 2^{np.log2(scale):.0f}: {100 * flushed_s:.4f}% round to 0, {100 * over_s:.4f}% overflow")
    ax.axvspan(bins[0], -25, color="tab:red", alpha=0.12)
    for x, text in ((-24, "2^-24 smallest subnormal"), (-14, "2^-14 smallest normal"),
                    (np.log2(65504.0), "65504 largest fp16")):
        ax.axvline(x, color="tab:red", ls="--", lw=1)
        ax.text(x + 0.2, ax.get_ylim()[1] * 0.95, text, rotation=90, va="top", fontsize=8, color="tab:red")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("elements")
    ax.set_title("gradient magnitudes against fp16's range (shaded: rounds to zero)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_loss_scale(scales, skipped=(), ax=None):
    """The loss scale used at each step (log2 axis), overflowing steps (skipped, then the scale halves) marked."""
    import numpy as np
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 3))
    else:
        fig = ax.figure
    steps = np.arange(1, len(scales) + 1)
    ax.step(steps, np.log2(scales), where="post", color="tab:purple", label="log2 scale")
    sk = [s for s in skipped if 1 <= s <= len(scales)]
    if sk:
        ax.plot(sk, [np.log2(scales[s - 1]) for s in sk], "rx", ms=8, label=f"overflow: step skipped ({len(sk)})")
    ax.set_xlabel("step")
    ax.set_ylabel("log2(loss scale)")
    ax.set_title("dynamic loss scaling: halve on overflow, double after growth_interval clean steps", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_precision_losses(result: dict, rtol: Optional[float] = None, reference: str = "fp32"):
    """Top: the training loss per step of each run of precision.compare_precisions(...), each with its own line
    style and markers (runs that track the reference lie on top of it; the markers show them). Bottom: each run's
    |loss - reference loss| / reference loss on a log scale, so a run 1e-5 and one 30% away both stay readable,
    with the tracking tolerance rtol as a line (below it: tracks)."""
    import numpy as np
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    ref = np.asarray(result[reference]["loss"], dtype=np.float64)
    steps = np.arange(1, len(ref) + 1)
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 2)), "P")]
    every = max(1, len(ref) // 10)
    floor = 1e-8                       # |deviation| 0 (bit-identical losses) is drawn here on the log axis
    for i, (name, run) in enumerate(result.items()):
        loss = np.asarray(run["loss"], dtype=np.float64)
        ls, marker = styles[i % len(styles)]
        label = name + (f" ({len(run['skipped'])} skipped)" if run.get("skipped") else "")
        kw = dict(color=f"C{i}", ls=ls, marker=marker, ms=4, markevery=(i * every // max(1, len(result)), every))
        if name == reference:
            top.plot(steps, loss, lw=2.5, alpha=0.5, label=f"{label} (reference)", **kw)
            continue
        dev = np.abs(loss - ref) / ref
        top.plot(steps, loss, lw=1.2, label=f"{label}: max |rel. dev.| {dev.max():.1e}", **kw)
        bottom.plot(steps, np.maximum(dev, floor), lw=1, label=name, **kw)
    bottom.set_yscale("log")
    lo, hi = bottom.get_ylim()
    if rtol is not None:
        bottom.axhline(rtol, color="tab:green", lw=1.2, label=f"tolerance {rtol:g}")
        bottom.axhspan(floor / 10, rtol, color="tab:green", alpha=0.08)
        lo, hi = min(lo, rtol / 10), max(hi, rtol * 10)
    bottom.set_ylim(max(lo, floor / 2), hi)
    top.set_ylabel("loss (nats per byte)")
    top.set_title("the same model, init and batches under each matmul precision", fontsize=10)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"|loss - {reference}| / {reference}")
    bottom.legend(fontsize=8, ncol=4, loc="lower right")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# ---- lesson 09: the full training loop ------------------------------------------------------------------------------

def plot_training_step(n_layer="L", ax=None):
    """One training step as a pipeline of boxes, each labelled with the lesson that built its kernel: the forward
    (batch -> embed -> n_layer blocks -> lnf -> head -> fused cross-entropy), one block opened up below it (LN, qkv
    matmul, attention, proj, LN, fc, GELU, proj), then the backward in reverse order, the global gradient norm and
    the fused AdamW with its half copy."""
    plt = _pyplot()
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
    if ax is None:
        fig, ax = plt.subplots(figsize=(13, 5.4))
    else:
        fig = ax.figure
    colors = {"data": "#d9d9d9", "fwd": "#c6dbef", "loss": "#fdd0a2", "bwd": "#fcbba1", "opt": "#c7e9c0"}

    def box(x, y, w, text, kind, lesson="", h=0.62):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    fc=colors[kind], ec="black", lw=0.8))
        ax.text(x + w / 2, y + h / 2 + (0.07 if lesson else 0), text, ha="center", va="center", fontsize=8.5)
        if lesson:
            ax.text(x + w / 2, y + 0.1, lesson, ha="center", va="center", fontsize=6.5, color="dimgray")
        return (x, y, w, h)

    def arrow(a, b, dy=0.0):
        ax.add_patch(FancyArrowPatch((a[0] + a[2], a[1] + a[3] / 2 + dy), (b[0], b[1] + b[3] / 2 + dy),
                                     arrowstyle="-|>", mutation_scale=9, lw=0.8, color="black"))

    # row 1: the forward of the whole model
    y1 = 4.0
    row1 = [("batch x, y\n(B, T) int32", "data", "L09 data", 1.5), ("embed\nwte[x] + wpe", "fwd", "L05", 1.4),
            (f"{n_layer} blocks", "fwd", "below", 1.6), ("lnf\nLayerNorm", "fwd", "L04", 1.3),
            ("head\nlnf @ wte.T", "fwd", "L02 cuBLAS", 1.5), ("fused CE\nloss, dlogits", "loss", "L05", 1.6)]
    x, prev, boxes1 = 0.1, None, []
    for text, kind, lesson, w in row1:
        b = box(x, y1, w, text, kind, lesson)
        if prev:
            arrow(prev, b)
        prev, x = b, x + w + 0.35
        boxes1.append(b)
    ax.text(0.1, y1 + 0.8, "forward, left to right ->", fontsize=8.5, color="tab:blue", va="center")
    # row 2: one block, opened up
    y2 = 2.55
    row2 = [("LN1", "L04", 0.8), ("qkv\nmatmul", "L02", 0.95), ("attention\nq k^T, softmax, @v", "L03 L05", 1.75),
            ("proj\n+ residual", "L02", 1.1), ("LN2", "L04", 0.8), ("fc\nmatmul", "L02", 0.95),
            ("GELU", "L05", 0.85), ("proj\n+ residual", "L02", 1.1)]
    x, prev, first = 0.9, None, None
    for text, lesson, w in row2:
        b = box(x, y2, w, text, "fwd", lesson)
        if prev:
            arrow(prev, b)
        first = first or b
        prev, x = b, x + w + 0.3
    blk = boxes1[2]
    ax.plot([blk[0], first[0] - 0.1, first[0] - 0.1], [y1, y1 - 0.35, y2 + 0.62 + 0.1], color="gray", lw=0.8, ls=":")
    ax.plot([blk[0] + blk[2], prev[0] + prev[2] + 0.1, prev[0] + prev[2] + 0.1],
            [y1, y1 - 0.35, y2 + 0.62 + 0.1], color="gray", lw=0.8, ls=":")
    ax.text(prev[0] + prev[2] + 0.25, y2 + 0.31, f"one block, x {n_layer}\n(checkpointing L08:\nrecompute, not keep)",
            fontsize=7.5, color="dimgray", va="center")
    first_bwd = None
    # row 3, right to left: the backward in reverse order, the global norm, AdamW
    y3 = 1.0
    row3 = [("backward of CE\n+ head (dlogits)", "bwd", "L05 L02", 1.75),
            (f"blocks {n_layer} .. 1\nin reverse", "bwd", "L02-L05", 1.6), ("embed backward\ndwte, dwpe", "bwd", "L05", 1.7),
            ("global norm\n||g||, one reduction", "opt", "L09", 1.9), ("clip coef\nmin(1, c/||g||)", "opt", "L09", 1.6),
            ("fused AdamW\n(+ half copy)", "opt", "L06 L07", 1.6)]
    x, prev = 13.55, None
    for text, kind, lesson, w in row3:
        x -= w
        b = box(x, y3, w, text, kind, lesson)
        if prev:
            ax.add_patch(FancyArrowPatch((prev[0], y3 + 0.31), (b[0] + b[2], y3 + 0.31), arrowstyle="-|>",
                                         mutation_scale=9, lw=0.8, color="black"))
        prev, x = b, x - 0.35
        if kind == "bwd" and first_bwd is None:
            first_bwd = b
    ax.text(prev[0], y3 - 0.28, "<- backward in reverse order, then the update (right to left)", fontsize=8.5,
            color="tab:red", va="center")
    ce = boxes1[-1]
    xr = 13.9
    ax.plot([ce[0] + ce[2], xr, xr], [y1 + 0.31, y1 + 0.31, y3 + 0.31], color="tab:red", lw=0.9, ls="--")
    ax.add_patch(FancyArrowPatch((xr, y3 + 0.31), (first_bwd[0] + first_bwd[2], y3 + 0.31), arrowstyle="-|>",
                                 mutation_scale=9, lw=0.9, color="tab:red", ls="--"))
    ax.set_xlim(0, 14.2)
    ax.set_ylim(0.35, 4.95)
    ax.axis("off")
    ax.legend(handles=[Patch(fc=c, ec="black", label=k) for k, c in
                       (("data", colors["data"]), ("forward", colors["fwd"]), ("loss", colors["loss"]),
                        ("backward", colors["bwd"]), ("optimizer", colors["opt"]))],
              loc="upper right", bbox_to_anchor=(1.0, 0.08), fontsize=7.5, ncol=5, frameon=False)
    ax.set_title("one training step, and the lesson (L02..L08) that built each kernel", fontsize=10)
    fig.tight_layout()
    return fig


class LiveLossPlot:
    """A loss plot that redraws in place in a notebook while a loop runs (an IPython display handle).

        live = LiveLossPlot(entropy=h)        # shows an empty figure under the cell
        live.update(records)                  # redraw with plot_loss(records); call it every k steps
    Outside IPython (a script, a test) update() only redraws the figure (self.fig), it displays nothing."""

    def __init__(self, entropy: Optional[float] = None, title: str = "GPT training loss (live)"):
        plt = _pyplot()
        self.entropy, self.title = entropy, title
        self.fig, self.ax = plt.subplots(figsize=(7, 4))
        plt.close(self.fig)                    # not shown again at the end of the cell: the handle shows it
        self.handle = None
        try:
            from IPython import get_ipython
            from IPython.display import display
            if get_ipython() is not None:
                self.handle = display(self.fig, display_id=True)
        except ImportError:
            pass
        self.redraws = 0

    def update(self, records) -> None:
        records = list(records)
        if not records:
            return
        self.ax.clear()
        plot_loss(records, entropy=self.entropy, ax=self.ax)
        self.ax.set_title(self.title, fontsize=10)
        self.redraws += 1
        if self.handle is not None:
            self.handle.update(self.fig)


def plot_step_profile(result: dict, title: str = "", ax=None):
    """Where one training step's time goes: horizontal bars of ms per step by op (bench_train.profile_step's dict,
    or the same built from OpProfiler.report()), largest at the top, the untimed remainder "other (CuPy ops,
    copies, Python)" highlighted."""
    plt = _pyplot()
    rows = sorted(result["rows"], key=lambda r: r["ms_per_step"])
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.4))
    else:
        fig = ax.figure
    other = [r["op"].startswith("other") for r in rows]
    colors = ["tab:orange" if o else "tab:blue" for o in other]
    y = range(len(rows))
    ax.barh(y, [r["ms_per_step"] for r in rows], color=colors, hatch=None)
    for i, r in enumerate(rows):
        ax.text(r["ms_per_step"], i, f" {r['ms_per_step']:.3g} ms ({100 * r['share']:.0f}%)", va="center", fontsize=7)
    ax.set_yticks(list(y), [r["op"] for r in rows], fontsize=8)
    for lab, o in zip(ax.get_yticklabels(), other):
        if o:
            lab.set_color("tab:orange")
            lab.set_fontweight("bold")
    ax.set_xlabel("ms per step")
    ax.set_xlim(0, 1.3 * max(r["ms_per_step"] for r in rows))
    ax.set_title(title or f"{result.get('preset', '')} {result.get('precision', '')} on {result.get('card', '?')}: "
                          f"{result['step_ms']:.3g} ms per step", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_step_timeline(result: dict, axes=None):
    """One traced training step launched from Python ("eager") above the same step replayed as a CUDA graph
    ("graph"), on one time axis (profiling.step_timeline's dict): per step, the CPU's launch calls and the GPU's
    kernels (cuBLAS products in blue, the course's kernels in orange, CuPy's in grey); the gaps in the GPU lane are
    the GPU waiting."""
    from .profiling import kernel_family
    plt = _pyplot()
    modes = [m for m in ("eager", "graph") if result.get(m)]
    if axes is None:
        fig, axes = plt.subplots(len(modes), 1, figsize=(9, 1.5 * len(modes) + 0.8), sharex=True, squeeze=False)
        axes = axes[:, 0]
    fig = axes[0].figure
    span = max(e["ts"] + e["dur"] for m in modes for e in result[m]["events"]
               if e["kind"] in ("kernel", "memcpy", "memset")) / 1e3
    colors = {"gemm (cuBLAS)": "tab:blue", "CuPy elementwise / reduction": "tab:gray"}
    for ax, mode in zip(axes, modes):
        ev = result[mode]["events"]
        launches = [(e["ts"] / 1e3, max(e["dur"] / 1e3, span / 2000)) for e in ev
                    if e["kind"] == "runtime" and "aunch" in e["name"]]
        ax.broken_barh(launches, (1.1, 0.8), color="tab:green")
        kernels = [e for e in ev if e["kind"] == "kernel"]
        for fam_color in ("tab:orange", "tab:gray", "tab:blue"):      # cuBLAS drawn last: thin bars stay visible
            bars = [(e["ts"] / 1e3, max(e["dur"] / 1e3, span / 2000)) for e in kernels
                    if colors.get(kernel_family(e["name"]), "tab:orange") == fam_color]
            ax.broken_barh(bars, (0.1, 0.8), color=fam_color)
        m = result[mode]
        ax.set_yticks([0.5, 1.5], ["GPU kernels", "CPU launches"], fontsize=8)
        ax.set_ylim(0, 2)
        ax.set_xlim(0, span * 1.01)
        ax.set_title(f"{mode}: {m['kernels']} kernels, GPU busy {m['gpu_busy_us'] / 1e3:.2f} ms of a "
                     f"{m['span_us'] / 1e3:.2f} ms step", fontsize=9)
    axes[-1].set_xlabel("ms from the start of the step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange", "tab:gray", "tab:green")]
    axes[0].legend(handles, ["cuBLAS", "course kernels", "CuPy", "launch call"], fontsize=7, ncol=4,
                   loc="upper right", bbox_to_anchor=(1, 1.55))
    fig.suptitle(f"{result['preset']} B{result['B']} T{result['T']} {result['precision']}, {result['card']} "
                 f"({result['date']})", fontsize=10, y=1.0)
    fig.tight_layout()
    return fig


def plot_train_bench(result: dict, axes=None):
    """Step time of our engine beside PyTorch eager (bench_train.bench_train's dict): one panel per preset, a pair
    of bars per precision, each labelled with its ms and our time / PyTorch's time."""
    plt = _pyplot()
    presets = list(dict.fromkeys(r["preset"] for r in result["rows"]))
    if axes is None:
        fig, axes = plt.subplots(1, len(presets), figsize=(4.6 * len(presets), 3.8), squeeze=False)
        axes = axes[0]
    else:
        fig = axes[0].figure
    who_color = {"ours": "tab:blue", "pytorch": "tab:gray"}
    for ax, preset in zip(axes, presets):
        rows = [r for r in result["rows"] if r["preset"] == preset]
        precs = list(dict.fromkeys(r["precision"] for r in rows))
        whos = list(dict.fromkeys(r["who"] for r in rows))
        width = 0.8 / len(whos)
        for j, who in enumerate(whos):
            for i, p in enumerate(precs):
                match = [r for r in rows if r["precision"] == p and r["who"] == who]
                if not match:
                    continue
                ms = match[0]["step_ms"]
                ax.bar(i + (j - (len(whos) - 1) / 2) * width, ms, width, color=who_color.get(who, f"C{j + 2}"),
                       label=who if i == 0 else None)
                text = f"{ms:.3g}"
                torch_rows = [r for r in rows if r["precision"] == p and r["who"] == "pytorch"]
                if who != "pytorch" and torch_rows:
                    text += f"\n{ms / torch_rows[0]['step_ms']:.2f}x"
                ax.text(i + (j - (len(whos) - 1) / 2) * width, ms, text, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(precs)), precs)
        ax.set_ylabel("ms per training step")
        ax.set_title(f"{preset} (B={rows[0]['B']}, T={rows[0]['T']})", fontsize=10)
        ax.set_ylim(0, 1.25 * max(r["step_ms"] for r in rows))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"training step: ours vs PyTorch eager, {result.get('card', '?')} ({result.get('date', '?')})",
                 fontsize=10)
    fig.tight_layout()
    return fig


# ---- lesson 10: collectives, the ring, all-reduce bandwidth, ZeRO memory ------------------------------------------

def _cells(ax, x0, y0, cells, size=0.9):
    """Draw a row of cells at (x0, y0): each (color, text) or None (an empty slot)."""
    from matplotlib.patches import Rectangle

    for i, cell in enumerate(cells):
        if cell is None:
            ax.add_patch(Rectangle((x0 + i, y0), size, size, fill=False, ls=":", ec="0.7"))
            continue
        color, text = cell
        ax.add_patch(Rectangle((x0 + i, y0), size, size, fc=color, ec="0.3", lw=0.8))
        ax.text(x0 + i + size / 2, y0 + size / 2, text, ha="center", va="center", fontsize=7,
                color="white" if color in ("0.25", "black") else "black")


def plot_collectives(N: int = 4, axes=None):
    """Broadcast, all-reduce, reduce-scatter and all-gather on N ranks: each rank's buffer before and after.

    A buffer is drawn as N chunks; a chunk's color is the rank whose data it holds, dark gray a sum over all ranks
    (its text: Σ and the chunk index)."""
    plt = _pyplot()
    if axes is None:
        fig, axes = plt.subplots(4, 2, figsize=(8.5, 8.5))
    fig = axes[0][0].figure
    col = [f"C{r}" for r in range(N)]
    SUM = "0.25"
    own = lambda r: [(col[r], f"r{r}.{c}") for c in range(N)]  # noqa: E731
    rows = [
        ("broadcast (root 0)", [own(0)] + [[None] * N for _ in range(1, N)], [own(0) for _ in range(N)],
         "rank 0's buffer copied to every rank"),
        ("all-reduce (sum)", [own(r) for r in range(N)], [[(SUM, f"Σ.{c}") for c in range(N)] for _ in range(N)],
         "every rank ends with the elementwise sum"),
        ("reduce-scatter (sum)", [own(r) for r in range(N)],
         [[(SUM, f"Σ.{r}") if c == r else None for c in range(N)] for r in range(N)],
         "rank r ends with the sum of chunk r only"),
        ("all-gather", [[(col[r], f"r{r}") if c == r else None for c in range(N)] for r in range(N)],
         [[(col[c], f"r{c}") for c in range(N)] for _ in range(N)], "every rank ends with every rank's chunk"),
    ]
    for (title, before, after, note), (ax_b, ax_a) in zip(rows, axes):
        for ax, state, when in ((ax_b, before, "before"), (ax_a, after, "after")):
            for r in range(N):
                ax.text(-0.3, N - 1 - r + 0.45, f"rank {r}", ha="right", va="center", fontsize=8)
                _cells(ax, 0, N - 1 - r, state[r])
            ax.set_xlim(-1.6, N + 0.1)
            ax.set_ylim(-0.2, N + 0.1)
            ax.set_aspect("equal")
            ax.axis("off")
            ax.set_title(f"{title}: {when}" + (f"\n{note}" if when == "after" else ""), fontsize=9)
    fig.suptitle(f"the four collectives on {N} ranks (a buffer = {N} chunks; color = whose data, dark = a sum)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_ring_steps(N: int, log, ax=None):
    """The ring all-reduce's chunk bookkeeping: one row per state (start, then after each of the 2(N-1) steps),
    one group of N chunks per rank. A chunk shows which ranks' data it holds (digits; Σ when all N), darker the more
    it holds; an outlined chunk is the one its rank sends to the right in the next step."""
    from matplotlib.patches import Rectangle
    from .parallel import ring_contributions

    plt = _pyplot()
    states = ring_contributions(N, log)
    if ax is None:
        fig, ax = plt.subplots(figsize=(1.2 + 1.15 * N * (N + 1) * 0.5, 0.6 + 0.55 * len(states)))
    else:
        fig = ax.figure
    cmap = plt.get_cmap("Blues")
    for k, state in enumerate(states):
        y = -k
        label = "start" if k == 0 else (f"reduce-scatter {k}" if k <= N - 1 else f"all-gather {k - N + 1}")
        ax.text(-0.4, y + 0.4, label, ha="right", va="center", fontsize=8)
        sends = {(src, c) for src, _, c in log[k]} if k < len(log) else set()
        for r in range(N):
            x0 = r * (N + 1)
            for c in range(N):
                held = state[r][c]
                frac = len(held) / N
                ax.add_patch(Rectangle((x0 + c, y), 0.9, 0.8, fc=cmap(0.15 + 0.75 * frac),
                                       ec="red" if (r, c) in sends else "0.4", lw=2.2 if (r, c) in sends else 0.6))
                text = "Σ" if len(held) == N else "".join(str(i) for i in sorted(held))
                ax.text(x0 + c + 0.45, y + 0.4, text, ha="center", va="center", fontsize=7,
                        color="white" if frac > 0.6 else "black")
    for r in range(N):
        ax.text(r * (N + 1) + N / 2 - 0.05, 1.05, f"rank {r}  (chunks 0..{N - 1})", ha="center", fontsize=8)
    ax.set_xlim(-3.2, N * (N + 1))
    ax.set_ylim(-len(states) + 0.6, 1.5)
    ax.axis("off")
    ax.set_title(f"ring all-reduce, N = {N}: {len(log)} steps = 2(N-1); red outline = the chunk each rank sends to "
                 f"rank r+1 next", fontsize=9)
    fig.tight_layout()
    return fig


def plot_allreduce_bandwidth(result: dict, ax=None):
    """Bus bandwidth (nccl-tests' busbw) against message size for each algorithm of a parallel.bench_result."""
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4))
    else:
        fig = ax.figure
    algos = list(dict.fromkeys(r["algo"] for r in result["rows"]))
    for i, algo in enumerate(algos):
        rows = [r for r in result["rows"] if r["algo"] == algo]
        name = {"ring": "ring by hand (sendrecv)", "nccl": "NCCL all-reduce", "mpi": "MPI all-reduce"}.get(algo, algo)
        ax.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o-", ms=3, label=name,
                color="tab:orange" if algo == "ring" else "tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [r["size_bytes"] for r in result["rows"] if r["algo"] == algos[0]]
    names = []
    for b in ticks:
        names.append(f"{b // 2**30}G" if b >= 2**30 else f"{b // 2**20}M" if b >= 2**20 else f"{b // 2**10}K"
                     if b >= 2**10 else f"{b}")
    ax.set_xticks(ticks, names, fontsize=7)
    ax.set_xlabel("message size (bytes, float32)")
    ax.set_ylabel("bus bandwidth GB/s\n= bytes/time x 2(N-1)/N")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"all-reduce on {result['world']} ranks, {result['comm']}: {result['card']} ({result['date']})",
                 fontsize=9)
    fig.tight_layout()
    return fig


def plot_zero_memory(rows, ax=None, unit=2**30):
    """Per-rank model-state memory, data parallel vs ZeRO-1, per world size (rows from parallel.zero_memory_table)."""
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.6))
    else:
        fig = ax.figure
    parts = (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green"))
    for i, row in enumerate(rows):
        for j, kind in enumerate(("dp", "zero1")):
            x, bottom = i + (j - 0.5) * 0.38, 0.0
            for part, color in parts:
                v = row[f"{kind}_{part}"] / unit
                ax.bar(x, v, 0.36, bottom=bottom, color=color, alpha=1.0 if kind == "zero1" else 0.55,
                       label=part if i == 0 and j == 1 else None)
                bottom += v
            ax.text(x, bottom, "DP" if kind == "dp" else "Z1", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [f"N = {r['world']}" for r in rows])
    ax.set_ylabel("GiB per rank" if unit == 2**30 else "MiB per rank")
    ax.set_ylim(0, 1.3 * max(r["dp_total"] for r in rows) / unit)
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("model state per rank: data parallel (DP, pale) vs ZeRO-1 (Z1): AdamW's m, v shrink as 1/N",
                 fontsize=9)
    fig.tight_layout()
    return fig


def show_kernel(fn, *args, op: Optional[str] = None, like=None, case: int = 0, **kw):
    """See your own kernel: run fn(*args) once in the CUDA simulator, print what its threads did and draw it
    (gpullm_lessons.kernel_trace: which thread wrote each output element, loads per thread, shared-memory traffic,
    32-byte sectors per warp load). Use tiny inputs (a few blocks of 32 threads), or instead of arrays pass
    like=check_xxx (the arguments that checker passes on its first, small case; case=k for its k-th) or
    op="softmax_backward" (tiny inputs of an op in kernel_trace.EXAMPLE_DIMS). kw go to kernel_trace.trace
    (warp_size=...).
    Returns the KernelTrace (None for a kernel not written yet). On a GPU it prints one line (tracing runs in the
    simulator only) and runs nothing."""
    from . import device, kernel_trace

    if (op is not None) + (like is not None) + bool(args) > 1:
        raise TypeError("show_kernel: pass the arrays, or like=check_..., or op=..., only one of them")
    if device.numba_on_gpu():
        print(f"show_kernel: {kernel_trace.SIM_ONLY}")
        return kernel_trace.trace(fn)
    from .checks import unfinished_kernel
    stub = unfinished_kernel(fn)
    if stub is not None:
        print(f"show_kernel: not attempted: {stub} still raises NotImplementedError (write it first)")
        return None
    if op is not None:
        args = kernel_trace.example_args(op)
    elif like is not None:
        args = kernel_trace.args_like(like, fn, case=case)
    t = kernel_trace.trace(fn, *args, **kw)
    if not t.available:
        print(f"show_kernel: {t.message}")
        return t
    print(t.summary())
    if t.launches:
        t.plot()
    return t
