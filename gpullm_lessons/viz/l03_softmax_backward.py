"""Lesson 03, softmax backward (row reductions): who owns which element under each mapping, the block
reduction (shared-memory tree, warp shuffle), and the fraction of the ceiling per kernel version (reused by
lessons 05 and 06)."""

from __future__ import annotations

from typing import Optional

from .common import pyplot


def plot_softmax_mapping(N: int = 6, n: int = 12, threads: int = 4, warp: int = 4, rows_per_block: int = 2):
    """Who owns which element of an (N, n) softmax-backward problem, for the three mappings of lesson 03.

    Left, v1: one thread per row (thread r walks row r). Middle, v2/v3: one block per row (block b owns row b, its
    threads stride the row: thread t takes columns t, t + threads, ...). Right, v4: one warp per row, several rows
    per block (`rows_per_block` warps of `warp` lanes). Cell colour: block; label: threadIdx.x (v4: the lane).
    Outlined cells: what the first warp reads in
    its first loop step, one load instruction: n elements apart in v1 (uncoalesced), neighbours in v2 and v4
    (coalesced). Drawn with `warp`-lane warps so it fits (a real warp has 32 lanes, 64 on AMD CDNA)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.55 * N + 2.2))
    colors = plt.get_cmap("tab10")
    panels = [
        (
            "v1: one thread per row",
            lambda r, j: (r // threads, r % threads),
            lambda r, j: j == 0 and r < warp,
            f"a warp's {warp} threads read column 0 of {warp} rows: addresses n*4 = {4 * n} bytes apart",
        ),
        (
            "v2 / v3: one block per row",
            lambda r, j: (r, j % threads),
            lambda r, j: r == 0 and j < min(warp, threads),
            f"thread t takes columns t, t+{threads}, ...: a warp reads {min(warp, threads)} neighbouring floats",
        ),
        (
            f"v4: one warp per row, {rows_per_block} rows per block",
            lambda r, j: (r // rows_per_block, j % warp),
            lambda r, j: r == 0 and j < warp,
            f"lane l takes columns l, l+{warp}, ...: a warp reads {warp} neighbouring floats",
        ),
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
    fig.suptitle(
        f"softmax backward, N = {N} rows of n = {n}: colour = block, number = threadIdx.x (v4: lane); "
        f"black outline = the first warp's first load",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def plot_block_reduction(threads: int = 8):
    """How a block adds its threads' partial sums: v2's shared-memory tree (left: at stride s, thread t < s adds
    partial[t + s]; a __syncthreads() between steps) beside a warp's xor-shuffle butterfly (right: every lane adds
    lane ^ offset's value; no shared memory, no barrier, and every lane ends with the total)."""
    plt = pyplot()
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
                        ax.annotate(
                            "",
                            (t, y - 1 + 0.3),
                            (t + offset, y - 0.3),
                            arrowprops=dict(arrowstyle="->", color="tab:orange", lw=1.2),
                        )
                        ax.plot([t, t], [y - 0.3, y - 1 + 0.3], color="tab:blue", lw=1)
                else:
                    ax.annotate(
                        "",
                        (t, y - 1 + 0.3),
                        (t ^ offset, y - 0.3),
                        arrowprops=dict(arrowstyle="->", color="tab:green", lw=0.9, alpha=0.8),
                    )
            note = (
                f"stride {offset}: t < {offset} adds partial[t + {offset}]; __syncthreads()"
                if kind == "tree"
                else f"offset {offset}: v += shfl_xor(v, {offset})"
            )
            ax.text(threads - 0.2, y - 0.5, note, va="center", fontsize=8)
            active = offset
        ax.set_xlim(-2.0, threads + 5.5)
        ax.set_ylim(-steps - 0.6, 0.9)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(
            "v2: tree in shared memory (the total ends in partial[0])"
            if kind == "tree"
            else "v3 / v4: warp shuffle butterfly (every lane ends with the total)",
            fontsize=10,
        )
    fig.suptitle(f"adding {threads} partial sums in log2({threads}) = {steps} steps", fontsize=10)
    fig.tight_layout()
    return fig


def plot_version_fractions(result: dict, target: Optional[float] = None, ax=None):
    """One bar per benchmarked row of `result` (bench.kernel_results): fraction of its ceiling (copy bandwidth for
    memory-bound ops), labelled backend + version, with an optional target line (e.g. 0.7)."""
    plt = pyplot()
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
