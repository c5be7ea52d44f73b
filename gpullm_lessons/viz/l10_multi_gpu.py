"""Lesson 10, multi-GPU: the four collectives, the ring all-reduce's steps, all-reduce bandwidth, ZeRO-1 memory."""

from __future__ import annotations

from .common import figure_and_axes, pyplot


def _cells(ax, x0, y0, cells, size=0.9):
    """Draw a row of cells at (x0, y0): each (color, text) or None (an empty slot)."""
    from matplotlib.patches import Rectangle

    for i, cell in enumerate(cells):
        if cell is None:
            ax.add_patch(Rectangle((x0 + i, y0), size, size, fill=False, ls=":", ec="0.7"))
            continue
        color, text = cell
        ax.add_patch(Rectangle((x0 + i, y0), size, size, fc=color, ec="0.3", lw=0.8))
        ax.text(
            x0 + i + size / 2,
            y0 + size / 2,
            text,
            ha="center",
            va="center",
            fontsize=7,
            color="white" if color in ("0.25", "black") else "black",
        )


def plot_collectives(N: int = 4, axes=None):
    """Broadcast, all-reduce, reduce-scatter and all-gather on N ranks: each rank's buffer before and after.

    A buffer is drawn as N chunks; a chunk's color is the rank whose data it holds, dark gray a sum over all ranks
    (its text: Σ and the chunk index)."""
    plt = pyplot()
    if axes is None:
        fig, axes = plt.subplots(4, 2, figsize=(8.5, 8.5))
    fig = axes[0][0].figure
    col = [f"C{r}" for r in range(N)]
    SUM = "0.25"
    own = lambda r: [(col[r], f"r{r}.{c}") for c in range(N)]  # noqa: E731
    rows = [
        (
            "broadcast (root 0)",
            [own(0)] + [[None] * N for _ in range(1, N)],
            [own(0) for _ in range(N)],
            "rank 0's buffer copied to every rank",
        ),
        (
            "all-reduce (sum)",
            [own(r) for r in range(N)],
            [[(SUM, f"Σ.{c}") for c in range(N)] for _ in range(N)],
            "every rank ends with the elementwise sum",
        ),
        (
            "reduce-scatter (sum)",
            [own(r) for r in range(N)],
            [[(SUM, f"Σ.{r}") if c == r else None for c in range(N)] for r in range(N)],
            "rank r ends with the sum of chunk r only",
        ),
        (
            "all-gather",
            [[(col[r], f"r{r}") if c == r else None for c in range(N)] for r in range(N)],
            [[(col[c], f"r{c}") for c in range(N)] for _ in range(N)],
            "every rank ends with every rank's chunk",
        ),
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
    fig.suptitle(
        f"the four collectives on {N} ranks (a buffer = {N} chunks; color = whose data, dark = a sum)", fontsize=10
    )
    fig.tight_layout()
    return fig


def plot_ring_steps(N: int, log, ax=None):
    """The ring all-reduce's chunk bookkeeping: one row per state (start, then after each of the 2(N-1) steps),
    one group of N chunks per rank. A chunk shows which ranks' data it holds (digits; Σ when all N), darker the more
    it holds; an outlined chunk is the one its rank sends to the right in the next step."""
    from matplotlib.patches import Rectangle
    from ..parallel import ring_contributions

    plt = pyplot()
    states = ring_contributions(N, log)
    fig, ax = figure_and_axes(ax, figsize=(1.2 + 1.15 * N * (N + 1) * 0.5, 0.6 + 0.55 * len(states)))
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
                ax.add_patch(
                    Rectangle(
                        (x0 + c, y),
                        0.9,
                        0.8,
                        fc=cmap(0.15 + 0.75 * frac),
                        ec="red" if (r, c) in sends else "0.4",
                        lw=2.2 if (r, c) in sends else 0.6,
                    )
                )
                text = "Σ" if len(held) == N else "".join(str(i) for i in sorted(held))
                ax.text(
                    x0 + c + 0.45,
                    y + 0.4,
                    text,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if frac > 0.6 else "black",
                )
    for r in range(N):
        ax.text(r * (N + 1) + N / 2 - 0.05, 1.05, f"rank {r}  (chunks 0..{N - 1})", ha="center", fontsize=8)
    ax.set_xlim(-3.2, N * (N + 1))
    ax.set_ylim(-len(states) + 0.6, 1.5)
    ax.axis("off")
    ax.set_title(
        f"ring all-reduce, N = {N}: {len(log)} steps = 2(N-1); red outline = the chunk each rank sends to "
        f"rank r+1 next",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def plot_allreduce_bandwidth(result: dict, ax=None):
    """Bus bandwidth (nccl-tests' busbw) against message size for each algorithm of a parallel.bench_result."""
    fig, ax = figure_and_axes(ax, figsize=(7, 4))
    algos = list(dict.fromkeys(r["algo"] for r in result["rows"]))
    for i, algo in enumerate(algos):
        rows = [r for r in result["rows"] if r["algo"] == algo]
        name = {"ring": "ring by hand (sendrecv)", "nccl": "NCCL all-reduce", "mpi": "MPI all-reduce"}.get(algo, algo)
        ax.plot(
            [r["size_bytes"] for r in rows],
            [r["busbw_GBps"] for r in rows],
            "o-",
            ms=3,
            label=name,
            color="tab:orange" if algo == "ring" else "tab:blue",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [r["size_bytes"] for r in result["rows"] if r["algo"] == algos[0]]
    names = []
    for b in ticks:
        names.append(
            f"{b // 2**30}G"
            if b >= 2**30
            else f"{b // 2**20}M"
            if b >= 2**20
            else f"{b // 2**10}K"
            if b >= 2**10
            else f"{b}"
        )
    ax.set_xticks(ticks, names, fontsize=7)
    ax.set_xlabel("message size (bytes, float32)")
    ax.set_ylabel("bus bandwidth GB/s\n= bytes/time x 2(N-1)/N")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(
        f"all-reduce on {result['world']} ranks, {result['comm']}: {result['card']} ({result['date']})", fontsize=9
    )
    fig.tight_layout()
    return fig


def plot_zero_memory(rows, ax=None, unit=2**30):
    """Per-rank model-state memory, data parallel vs ZeRO-1, per world size (rows from parallel.zero_memory_table)."""
    fig, ax = figure_and_axes(ax, figsize=(7, 3.6))
    parts = (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green"))
    for i, row in enumerate(rows):
        for j, kind in enumerate(("dp", "zero1")):
            x, bottom = i + (j - 0.5) * 0.38, 0.0
            for part, color in parts:
                v = row[f"{kind}_{part}"] / unit
                ax.bar(
                    x,
                    v,
                    0.36,
                    bottom=bottom,
                    color=color,
                    alpha=1.0 if kind == "zero1" else 0.55,
                    label=part if i == 0 and j == 1 else None,
                )
                bottom += v
            ax.text(x, bottom, "DP" if kind == "dp" else "Z1", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [f"N = {r['world']}" for r in rows])
    ax.set_ylabel("GiB per rank" if unit == 2**30 else "MiB per rank")
    ax.set_ylim(0, 1.3 * max(r["dp_total"] for r in rows) / unit)
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(
        "model state per rank: data parallel (DP, pale) vs ZeRO-1 (Z1): AdamW's m, v shrink as 1/N", fontsize=9
    )
    fig.tight_layout()
    return fig
