"""Lesson 11's figures and tables: the memory traffic of attention with and without the (T, T) scores, and the tile
grid of the causal flash kernels (which key tiles a block of query rows loads, which it skips)."""

from __future__ import annotations

from .common import figure_and_axes


def causal_tiles(T: int, rows: int, tile: int) -> dict:
    """The key tiles the flash forward loads for a sequence of T, blocks of `rows` query rows, tiles of `tile` keys:
    a block with query rows t0 .. t1 loads the tiles starting at s0 <= t1. Returns {"blocks", "tiles" (one block's
    full row of tiles), "loaded", "all" (blocks x tiles), "straddling" (loaded tiles that hold keys above the
    diagonal for some row of the block), "key_rows_loaded"}."""
    import math

    if T < 1 or rows < 1 or tile < 1:
        raise ValueError(f"causal_tiles: T, rows and tile must be positive, got T={T}, rows={rows}, tile={tile}")
    blocks, tiles = math.ceil(T / rows), math.ceil(T / tile)
    loaded = straddling = key_rows = 0
    for i in range(blocks):
        t0, t1 = i * rows, min(T, (i + 1) * rows) - 1
        for j in range(tiles):
            s0, s1 = j * tile, min(T, (j + 1) * tile) - 1
            if s0 > t1:
                break
            loaded += 1
            key_rows += s1 - s0 + 1
            straddling += s1 > t0
    return {
        "blocks": blocks,
        "tiles": tiles,
        "loaded": loaded,
        "all": blocks * tiles,
        "straddling": straddling,
        "key_rows_loaded": key_rows,
    }


def attention_traffic(B: int, nh: int, T: int, hs: int, rows: int = 64, tile: int = 32, elem: int = 4) -> dict:
    """Bytes one attention layer's forward moves to and from GPU memory, by a model of each path (elem bytes per value):
    scores: S = q k^T written, read by the softmax, P written, read by P v (4 passes over B nh T^2), plus q, k, v, out;
    flash: q read once, k and v once per block of query rows that needs them (causal_tiles), out and lse written;
    flash_once: the same with k and v read from memory once per head (the blocks' re-reads served by the L2 cache).
    Returns {"scores_matrix", "scores_path", "flash", "flash_once", "qkv_out"} in bytes."""
    heads = B * nh
    qkv_out = 4 * heads * T * hs * elem
    ct = causal_tiles(T, rows, tile)
    flash = heads * (T * hs + 2 * ct["key_rows_loaded"] * hs + T * hs + T) * elem
    matrix = heads * T * T * elem
    return {
        "scores_matrix": matrix,
        "scores_path": 4 * matrix + qkv_out,
        "flash": flash,
        "flash_once": qkv_out + heads * T * elem,
        "qkv_out": qkv_out,
    }


def format_attention_traffic(B: int, nh: int, hs: int, Ts=(256, 1024, 4096), rows: int = 64, tile: int = 32) -> str:
    """The table of attention_traffic for each T, fp32 and bf16 scores (elem 4 and 2)."""
    lines = [
        f"one attention layer's forward, B={B} nh={nh} hs={hs}; flash: blocks of {rows} query rows, tiles of "
        f"{tile} keys",
        f"{'T':>6}{'elem':>6}{'S for all heads':>17}{'scores path':>14}{'flash':>11}{'ratio':>7}"
        f"{'flash, k v once':>17}{'ratio':>7}",
    ]

    def _mb(n: int) -> str:
        return f"{n / 1e6:,.0f} MB" if n >= 1e7 else f"{n / 1e6:.2f} MB"

    for T in Ts:
        for elem in (4, 2):
            a = attention_traffic(B, nh, T, hs, rows, tile, elem)
            lines.append(
                f"{T:>6}{'fp32' if elem == 4 else 'bf16':>6}{_mb(a['scores_matrix']):>17}"
                f"{_mb(a['scores_path']):>14}{_mb(a['flash']):>11}{a['scores_path'] / a['flash']:>6.1f}x"
                f"{_mb(a['flash_once']):>17}{a['scores_path'] / a['flash_once']:>6.0f}x"
            )
    return "\n".join(lines)


def plot_causal_tiles(T: int, rows: int, tile: int, ax=None):
    """The T x T score matrix as a grid of (block of query rows) x (key tile) cells: loaded and entirely below the
    diagonal, loaded and straddling it (masked per element), skipped (above the diagonal for every row)."""
    import math

    from matplotlib.patches import Patch, Rectangle

    fig, ax = figure_and_axes(ax, (4.6, 4.2))
    blocks, tiles = math.ceil(T / rows), math.ceil(T / tile)
    colors = {"full": "#4c72b0", "straddle": "#9ecae1", "skip": "#f0f0f0"}
    for i in range(blocks):
        t0, t1 = i * rows, min(T, (i + 1) * rows) - 1
        for j in range(tiles):
            s0, s1 = j * tile, min(T, (j + 1) * tile) - 1
            kind = "skip" if s0 > t1 else ("straddle" if s1 > t0 else "full")
            ax.add_patch(
                Rectangle((s0, t0), s1 - s0 + 1, t1 - t0 + 1, facecolor=colors[kind], edgecolor="white", lw=0.8)
            )
    ax.plot([0, T], [0, T], color="#c44e52", lw=1.2)
    ax.set_xlim(0, T)
    ax.set_ylim(T, 0)
    ax.set_xlabel(f"key s (tiles of {tile})")
    ax.set_ylabel(f"query t (blocks of {rows} rows)")
    ct = causal_tiles(T, rows, tile)
    ax.set_title(
        f"T = {T}: {ct['loaded']} of {ct['all']} tiles loaded, {ct['straddling']} straddle the diagonal", fontsize=9
    )
    ax.legend(
        handles=[
            Patch(color=colors["full"], label="loaded, below the diagonal"),
            Patch(color=colors["straddle"], label="loaded, masked per element"),
            Patch(color=colors["skip"], label="skipped"),
        ],
        fontsize=7,
        loc="upper right",
    )
    fig.tight_layout()
    return fig


def merge_halves(x, v, split: int) -> dict:
    """Softmax-weighted average of the rows of v by the scores x, computed whole and from two halves merged:
    each half's (max m, sum l, normalised output o), then m = max(m1, m2), l = l1 e^(m1 - m) + l2 e^(m2 - m),
    o = (l1 e^(m1 - m) o1 + l2 e^(m2 - m) o2) / l. Returns both, with the log-sum-exp m + log l."""
    import numpy as np

    x, v = np.asarray(x, dtype=np.float64), np.asarray(v, dtype=np.float64)

    def part(xs, vs):
        m = xs.max()
        e = np.exp(xs - m)
        return m, e.sum(), e @ vs / e.sum()

    (m1, l1, o1), (m2, l2, o2) = part(x[:split], v[:split]), part(x[split:], v[split:])
    m = max(m1, m2)
    w1, w2 = l1 * np.exp(m1 - m), l2 * np.exp(m2 - m)
    m_all, l_all, o_all = part(x, v)
    return {
        "whole": o_all,
        "merged": (w1 * o1 + w2 * o2) / (w1 + w2),
        "lse_whole": m_all + np.log(l_all),
        "lse_merged": m + np.log(w1 + w2),
        "halves": ((m1, l1), (m2, l2)),
    }


def register_tile_layout(vendor: str) -> dict:
    """Which lane of a warp holds each element of a 16 x 16 fp32 result tile in v3's register tiles (portable.h),
    as the vendors document it: NVIDIA's mma.sync.m16n8k16 (two 16 x 8 results side by side; lane = 4 g + c holds
    rows g and g + 8, columns 2c, 2c + 1 and 8 + 2c, 8 + 2c + 1) and AMD's MFMA 16x16x16 as v3 uses it (the product
    computed transposed, so lane l holds row l % 16, columns 4 (l // 16) .. + 3). Returns the (16, 16) lane map, the
    lanes per warp, and the lanes that share each row (what a row's max and sum must be combined over)."""
    import numpy as np

    if vendor not in ("nvidia", "amd"):
        raise ValueError(f"register_tile_layout: vendor must be 'nvidia' or 'amd', got {vendor!r}")
    lanes = np.full((16, 16), -1, dtype=np.int64)
    if vendor == "nvidia":
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for e in range(8):
                lanes[g + 8 * ((e % 4) // 2), 8 * (e // 4) + 2 * c + e % 2] = lane
        warp = 32
    else:
        for lane in range(64):
            for e in range(4):
                lanes[lane % 16, 4 * (lane // 16) + e] = lane
        warp = 64
    return {"lanes": lanes, "warp": warp, "row_lanes": [sorted(set(lanes[r].tolist())) for r in range(16)]}


def format_register_tile_layout(vendor: str) -> str:
    """The lane map of register_tile_layout as text: one row per tile row, the lane number of each element."""
    lay = register_tile_layout(vendor)
    head = "     " + "".join(f"{j:>4}" for j in range(16))
    rows = [f"{i:>3}  " + "".join(f"{lane:>4}" for lane in lay["lanes"][i]) for i in range(16)]
    return "\n".join(
        [f"{vendor}: lane holding each element of a 16 x 16 result tile (rows down, columns across)", head, *rows]
    )
