"""Lesson 04, LayerNorm backward: dinp one block per row, dweight/dbias by the two-stage column reduction."""

from __future__ import annotations

from .common import figure_and_axes, pyplot


def plot_layernorm_dinp_mapping(N: int = 4, C: int = 12, threads: int = 4, ax=None):
    """LayerNorm backward dinp, one block per row (kernels v2/v3): each cell of the (N, C) array is labelled with the
    thread that owns it (thread t: channels t, t + blockDim.x, ...), coloured by its block (= its row). Below: the
    shared-memory tree that turns the block's per-thread partial sums of g and g*xhat into the two row means."""
    plt = pyplot()
    if ax is None:
        fig, (ax, ax_tree) = plt.subplots(
            2, 1, figsize=(min(0.55 * C + 6, 16), 0.5 * N + 3.2), gridspec_kw={"height_ratios": [N + 1.2, 3.2]}
        )
    else:
        fig, ax_tree = ax.figure, None
    colors = plt.get_cmap("tab10")
    for row in range(N):
        y = N - 1 - row
        for c in range(C):
            ax.add_patch(plt.Rectangle((c, y), 0.95, 0.9, color=colors(row % 10), alpha=0.65))
            ax.text(c + 0.47, y + 0.45, f"t{c % threads}", ha="center", va="center", fontsize=7)
        ax.text(-0.3, y + 0.45, f"block {row}\n(row {row})", ha="right", va="center", fontsize=8)
        ax.annotate(
            "", xy=(C + 1.2, y + 0.45), xytext=(C + 0.1, y + 0.45), arrowprops=dict(arrowstyle="->", color="gray")
        )
        ax.text(
            C + 1.3,
            y + 0.45,
            "sum g, sum g*xhat (tree) -> mean(g), mean(g*xhat) -> write dinp[row, :]",
            va="center",
            fontsize=7.5,
        )
    for c in range(C):
        ax.text(c + 0.47, N + 0.1, str(c), ha="center", va="bottom", fontsize=7, color="gray")
    ax.text(
        C / 2,
        N + 0.65,
        f"channel c  (thread t owns c = t, t + {threads}, ...: neighbouring threads read neighbouring addresses)",
        ha="center",
        fontsize=8,
        color="gray",
    )
    ax.set_xlim(-2.4, C + 13)
    ax.set_ylim(-0.3, N + 1.2)
    ax.axis("off")
    ax.set_title(f"dinp: one block of {threads} threads per row, N = {N} rows, C = {C} channels", fontsize=10)
    if ax_tree is not None:
        # tree for one block: level 0 = per-thread partial sums, each level the lower half adds the upper half
        u = C / threads  # the tree spans the row's width
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
            ax_tree.text(
                -0.3, y + 0.35, "partials" if li == 0 else f"stride {n}", ha="right", va="center", fontsize=7.5
            )
        ax_tree.text(
            C + 0.5,
            len(levels) / 2,
            f"block 0's tree in shared memory: {len(levels) - 1} steps of (buf[t] += buf[t + stride]; "
            f"syncthreads)\ndone twice side by side (g and g*xhat); v3 does the same sums with warp shuffles",
            va="center",
            fontsize=8,
        )
        ax_tree.set_xlim(-2.4, C + 13)
        ax_tree.set_ylim(-0.2, len(levels) + 0.1)
        ax_tree.axis("off")
    fig.tight_layout()
    return fig


def plot_column_reduction(N: int = 12, C: int = 8, threads: int = 4, rows_per_chunk: int = 4, ax=None):
    """dweight/dbias by the two-stage column reduction (kernels v2_partials + v2_reduce): block (bx, by) owns a
    column block and a chunk of rows; each thread sums its column over the chunk into the partials (n_chunks, C);
    then one thread per column adds the n_chunks partials, always in the same order (deterministic)."""
    plt = pyplot()
    n_chunks = (N + rows_per_chunk - 1) // rows_per_chunk
    fig, ax = figure_and_axes(ax, figsize=(min(1.6 * C + 6, 17), 0.42 * N + 2.2))
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
    if n_chunks > 1 and C > threads:  # outline one block: column block 1, chunk 1
        y_lo = N - min(N, 2 * rows_per_chunk)
        ax.add_patch(
            plt.Rectangle(
                (threads - 0.05, y_lo - 0.05),
                min(threads, C - threads) + 0.05,
                min(N, 2 * rows_per_chunk) - rows_per_chunk + 0.05,
                fill=False,
                lw=2.2,
                edgecolor="black",
                ls="--",
            )
        )
        ax.text(
            threads + min(threads, C - threads) / 2,
            y_lo + 0.45,
            "block (1, 1)",
            ha="center",
            va="center",
            fontsize=8,
            fontweight="bold",
        )
    for k in range(n_chunks):
        y_mid = N - (k * rows_per_chunk + min(N, (k + 1) * rows_per_chunk)) / 2
        ax.text(-0.3, y_mid, f"chunk {k}\n(blockIdx.y = {k})", ha="right", va="center", fontsize=7.5)
    ax.text(
        C / 2, N + 0.35, "dout, xhat (N, C): column blocks (blockIdx.x) split by black lines", ha="center", fontsize=8
    )
    # stage 1 -> partials (n_chunks, C)
    x0 = C + 3
    top = N - 1 - (N - n_chunks) / 2
    for k in range(n_chunks):
        y = top - k
        for c in range(C):
            ax.add_patch(plt.Rectangle((x0 + c, y), 0.95, 0.9, color=colors(k % 10), alpha=0.85))
        ax.text(x0 + C + 0.2, y + 0.45, f"partial[{k}, :]", va="center", fontsize=7)
    ax.annotate("", xy=(x0 - 0.3, N / 2), xytext=(C + 0.3, N / 2), arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.text(
        (C + x0) / 2 - 0.2,
        N / 2 + 0.6,
        "stage 1\neach thread: its\ncolumn over\none chunk",
        ha="center",
        va="bottom",
        fontsize=7.5,
    )
    ax.text(x0 + C / 2, top + 1.3, f"partials (n_chunks = {n_chunks}, C)", ha="center", fontsize=8)
    # stage 2 -> (C,)
    x1 = x0 + C + 5
    y = N / 2 - 0.45
    for c in range(C):
        ax.add_patch(plt.Rectangle((x1 + c, y), 0.95, 0.9, color="dimgray", alpha=0.8))
        ax.text(x1 + c + 0.47, y + 0.45, f"c{c}", ha="center", va="center", fontsize=6.5, color="white")
    ax.annotate("", xy=(x1 - 0.3, N / 2), xytext=(x0 + C + 2.2, N / 2), arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.text(
        x0 + C + 2.7,
        N / 2 - 0.9,
        "stage 2\none thread per\ncolumn, chunks\nin order",
        ha="center",
        va="top",
        fontsize=7.5,
    )
    ax.text(x1 + C / 2, y + 1.3, "dweight, dbias (C,)", ha="center", fontsize=8)
    ax.set_xlim(-3.2, x1 + C + 0.5)
    ax.set_ylim(-0.4, N + 1.0)
    ax.axis("off")
    ax.set_title(
        f"dweight, dbias: two-stage column reduction (N = {N}, C = {C}, {threads} threads per block, "
        f"{rows_per_chunk} rows per chunk)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
