"""Lesson 02, linear backward: the tiled GEMM, the bias-gradient column sum, the achieved TFLOP/s, and the
roofline of a kernel benchmark (reused by lessons 03-05 and `python -m gpullm_lessons.bench --plot`)."""

from __future__ import annotations

from .common import figure_and_axes, pyplot


def plot_roofline(result: dict, path=None, ax=None):
    """Roofline of a kernel benchmark (bench.bench_kernels): achieved TFLOP/s against arithmetic intensity
    (FLOPs per byte), under the measured copy-bandwidth slope and the fp32 matmul ceiling of the same run."""
    import numpy as np

    plt = pyplot()
    fig, ax = figure_and_axes(ax, figsize=(8, 5))
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
        ax.scatter(
            x,
            r["TFLOP/s"],
            marker=markers.get(r["backend"], "x"),
            color=colors(ops.index(r["op"]) % 10),
            s=40,
            alpha=0.8,
        )
        ax.annotate(
            f"{r['backend'][0]}{r['version'] if r['backend'] != 'torch' else ''}",
            (x, r["TFLOP/s"]),
            fontsize=6,
            xytext=(3, 2),
            textcoords="offset points",
        )
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


def plot_tiled_gemm(
    M: int = 12, P: int = 16, K: int = 12, tile: int = 4, block=(2, 1), step: int = 1, thread=(2, 1), ax=None
):
    """The tiled GEMM out (M, P) = op(A) (M, K) @ op(B) (K, P) of lesson 02 (kernels/numba/linear.py, v2), drawn
    in the classic layout: op(A) left of out, op(B) above it, so a row of A lines up with its row of out and a
    column of B with its column. block = (bx, by) owns the orange tile of out (tile x tile elements, one per thread);
    it walks along K in steps of `tile`: at step `step` it copies the dark tile of A and the dark tile of B into
    shared memory (one element per thread each), syncs, and every thread reads a row of the A tile and a column of
    the B tile from there. Each element copied is used by `tile` threads. thread = (tx, ty) marks one thread's
    element of out and the shared-memory row and column it reads."""
    plt = pyplot()
    bx, by = block
    tx, ty = thread
    steps = (K + tile - 1) // tile
    fig, ax = figure_and_axes(ax, figsize=(11, 8.2))
    gap = 1.5
    i0, j0, k0 = by * tile, bx * tile, step * tile

    def cell(x, y, **kw):
        ax.add_patch(plt.Rectangle((x, y), 1, 1, lw=0.4, ec="0.7", **kw))

    def operand_cell(x, y, k, in_strip, dark, pale):
        """A cell of op(A) or op(B) at depth k: in the block's strip it is dark while step `step` copies it, pale
        otherwise, hatched once an earlier step has copied it."""
        now = in_strip and k0 <= k < k0 + tile
        done = in_strip and k < k0
        color = dark if now else (pale if in_strip else "white")
        cell(x, y, fc=color, alpha=0.85 if now else 1.0, hatch="///" if done else None)

    # op(A): columns k at x = k - K - gap, rows i at y = i
    for i in range(M):
        for k in range(K):
            operand_cell(k - K - gap, i, k, i0 <= i < i0 + tile, "tab:blue", "#cfe0f3")
    # op(B): columns j at x = j, rows k at y = k - K - gap
    for k in range(K):
        for j in range(P):
            operand_cell(j, k - K - gap, k, j0 <= j < j0 + tile, "tab:green", "#d5ecd5")
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
            ax.text(
                bx_ * tile + tile / 2,
                by_ * tile + tile / 2,
                f"block\n({bx_}, {by_})",
                ha="center",
                va="center",
                fontsize=7,
                color="0.25" if (bx_, by_) != (bx, by) else "black",
                weight="bold" if (bx_, by_) == (bx, by) else None,
            )
    # one thread: its element of out, the row of the A tile and the column of the B tile it reads
    i, j = i0 + ty, j0 + tx
    ax.add_patch(plt.Rectangle((j, i), 1, 1, fill=False, ec="red", lw=2.2))
    ax.add_patch(plt.Rectangle((k0 - K - gap, i), tile, 1, fill=False, ec="red", lw=2.2))
    ax.add_patch(plt.Rectangle((j, k0 - K - gap), 1, tile, fill=False, ec="red", lw=2.2))
    ax.annotate(
        f"thread (tx={tx}, ty={ty}) owns out[{i}, {j}]",
        (j + 1, i + 0.5),
        (P + 0.6, i0 + tile + 1.5),
        fontsize=8,
        color="red",
        arrowprops=dict(arrowstyle="->", color="red", lw=1),
    )
    # labels
    ax.text(-K / 2 - gap, -0.6, "op(A)  (M, K)", ha="center", fontsize=10)
    ax.text(P / 2, -K - gap - 0.6, "op(B)  (K, P)", ha="center", fontsize=10)
    ax.text(P / 2, M + 0.9, "out  (M, P)", ha="center", fontsize=10)
    ax.text(
        -K - gap - 0.4,
        i0 + tile / 2,
        f"rows {i0}..{i0 + tile - 1}\n(block row by = {by})",
        ha="right",
        va="center",
        fontsize=8,
    )
    ax.text(j0 + tile / 2, -K - gap - 1.7, f"columns {j0}..{j0 + tile - 1} (bx = {bx})", ha="center", fontsize=8)
    note = (
        f"block ({bx}, {by}) walks K in {steps} steps of TILE = {tile}.  Step {step} (k = {k0}..{k0 + tile - 1}): "
        f"its {tile * tile} threads copy the dark {tile}x{tile} tile of op(A) and of op(B)\n"
        f"into shared memory (one element each), syncthreads(), then each thread adds {tile} products "
        f"sa[ty, kk] * sb[kk, tx]; syncthreads() again before the next step.\n"
        f"Hatched: steps already done. Every element copied is read by {tile} threads: "
        f"global-memory loads drop {tile}x compared with v1 (real TILE = 16: 16x)."
    )
    ax.text(-K - gap, M + 2.2, note, fontsize=8.5, va="top")
    ax.text(
        k0 - K - gap + tile / 2,
        i0 - 0.25,
        "-> sa (shared)",
        ha="center",
        va="bottom",
        fontsize=8,
        color="tab:blue",
        weight="bold",
    )
    ax.text(
        j0 + tile + 0.3,
        k0 - K - gap + tile / 2,
        "-> sb (shared)",
        ha="left",
        va="center",
        fontsize=8,
        color="tab:green",
        weight="bold",
    )
    ax.set_xlim(-K - gap - 6.5, P + 7.5)
    ax.set_ylim(M + 5.2, -K - gap - 2.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        f"tiled GEMM (v2): out = op(A) @ op(B), M = {M}, P = {P}, K = {K}, TILE = {tile} "
        f"(one block = TILE x TILE threads = one tile of out)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def plot_dbias_columns(N: int = 6, OC: int = 12, threads: int = 4, warp: int = 4, ax=None):
    """dbias = dout.sum(axis=0), one thread per output column o (kernels/numba/linear.py dbias_v1): thread o walks
    down column o adding the N rows. Colour: block; label: threadIdx.x. In loop step n the threads of a warp read
    row n's neighbouring columns together (outlined: one load instruction, coalesced)."""
    plt = pyplot()
    fig, ax = figure_and_axes(ax, figsize=(min(0.75 * OC + 3, 15), 0.55 * N + 2.6))
    colors = plt.get_cmap("tab10")
    for n in range(N):
        for o in range(OC):
            b, t = divmod(o, threads)
            ax.add_patch(plt.Rectangle((o, n), 0.95, 0.9, color=colors(b % 10), alpha=0.45))
            ax.text(o + 0.47, n + 0.45, f"t{t}" if n == 0 else "", ha="center", va="center", fontsize=7)
        ax.text(-0.3, n + 0.45, f"n = {n}", ha="right", va="center", fontsize=8)
    ax.add_patch(plt.Rectangle((0, 0), min(warp, OC) - 0.05, 0.9, fill=False, ec="black", lw=2.2))
    for o in range(OC):
        ax.annotate(
            "",
            (o + 0.47, N + 0.55),
            (o + 0.47, 0.75),
            arrowprops=dict(arrowstyle="->", color=colors((o // threads) % 10), lw=1, alpha=0.8),
        )
        ax.add_patch(plt.Rectangle((o, N + 0.6), 0.95, 0.9, color=colors((o // threads) % 10), alpha=0.85))
        ax.text(o + 0.47, N + 1.05, str(o), ha="center", va="center", fontsize=7, color="white")
    ax.text(-0.3, N + 1.05, "dbias[o]", ha="right", va="center", fontsize=8)
    ax.text(
        OC / 2,
        -0.5,
        f"dout (N = {N}, OC = {OC}); colour = block of {threads} threads, t = threadIdx.x",
        ha="center",
        fontsize=9,
    )
    ax.text(
        OC / 2,
        N + 2.1,
        f"thread o adds dout[0, o] + dout[1, o] + ... + dout[{N - 1}, o] (a loop over rows, "
        f"no communication between threads).\nBlack outline: what one warp of {warp} threads reads in loop step "
        f"n = 0, neighbouring addresses = one coalesced load.",
        ha="center",
        va="top",
        fontsize=8,
    )
    ax.set_xlim(-1.6, OC + 0.2)
    ax.set_ylim(N + 3.2, -1.0)
    ax.axis("off")
    ax.set_title("bias gradient: a column reduction, one thread per output channel", fontsize=10)
    fig.tight_layout()
    return fig


def plot_linear_rates(result: dict, ax=None):
    """Bars of achieved TFLOP/s for each linear_backward row of a kernel benchmark (bench.kernel_results), with the
    fp32 matmul ceiling measured in the same run as a dashed line; labels give ms and % of that ceiling."""
    rows = [r for r in result["rows"] if r["op"] == "linear" and "error" not in r]
    fig, ax = figure_and_axes(ax, figsize=(8.5, 0.42 * len(rows) + 1.8))
    peak = result["ceilings"]["matmul_fp32"]["TFLOP/s"]
    colors = {"numba": "tab:blue", "hip": "tab:orange", "torch": "tab:red"}
    ax.barh(range(len(rows)), [r["TFLOP/s"] for r in rows], color=[colors.get(r["backend"], "gray") for r in rows])
    for k, r in enumerate(rows):
        ax.text(
            r["TFLOP/s"] + 0.01 * peak,
            k,
            f"{r['ms']:.2f} ms, {100 * r['TFLOP/s'] / peak:.0f}%",
            va="center",
            fontsize=8,
        )
    ax.axvline(peak, color="black", ls="--", lw=1)
    ax.set_yticks(range(len(rows)), [f"{r['backend']} {r['version']}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * peak)
    ax.set_xlabel("achieved TFLOP/s (4 N C OC + N OC flops per call)")
    shape = rows[0]["shape"] if rows else ""
    ax.set_title(
        f"linear backward {shape} on {result['card']} ({result['date']})\n"
        f"dashed: the fp32 matmul ceiling measured in the same run, {peak:.1f} TFLOP/s",
        fontsize=10,
    )
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig
