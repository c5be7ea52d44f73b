"""Lesson 13's figures: the model state per rank of each parallel strategy against the world size, and measured
collective times beside the alpha-beta model fitted to them."""

from __future__ import annotations

from .common import figure_and_axes

STRATEGY_STYLE = {
    "dp": ("data parallel", "tab:gray", "o"),
    "zero1": ("ZeRO-1", "tab:blue", "v"),
    "zero2": ("ZeRO-2", "tab:cyan", "^"),
    "zero3": ("ZeRO-3", "tab:green", "s"),
    "tensor": ("tensor", "tab:red", "D"),
    "pipeline": ("pipeline", "tab:purple", "P"),
    "ulysses": ("Ulysses", "tab:olive", "x"),
}


def plot_state_per_rank(curves: dict, name: str, card_bytes=None, precision="bf16", ax=None):
    """GiB of model state per rank for each strategy against N, log-log. curves: strategy -> [(N, bytes)] (what
    parallel.plan.state_curves gives: each strategy only at the N it can split the model over); card_bytes draws the
    card's memory as a line."""
    fig, ax = figure_and_axes(ax, figsize=(7, 3.8))
    worlds = sorted({N for pts in curves.values() for N, _ in pts})
    for strategy, pts in curves.items():
        label, color, marker = STRATEGY_STYLE[strategy]
        if pts:
            ax.plot(
                [N for N, _ in pts], [b / 2**30 for _, b in pts], marker=marker, color=color, label=label, lw=1.2, ms=4
            )
    if card_bytes:
        ax.axhline(card_bytes / 2**30, color="k", ls="--", lw=1)
        ax.text(worlds[0], card_bytes / 2**30 * 1.08, f"one card: {card_bytes / 2**30:.0f} GiB", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(worlds), [str(N) for N in worlds])
    ax.set_xlabel("ranks N")
    ax.set_ylabel("GiB per rank (model state)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=3)
    ax.set_title(f"{name}, {precision}: params, half copy, grads and AdamW's m, v per rank", fontsize=9)
    fig.tight_layout()
    return fig


def plot_alpha_beta(rows, fit: dict, world: int, title: str, ax=None):
    """Measured all-reduce times (rows: size_bytes, time_us) as points and the fitted alpha + f n beta as a line."""
    import numpy as np

    fig, ax = figure_and_axes(ax, figsize=(6.5, 3.6))
    n = np.array([r["size_bytes"] for r in rows], dtype=float)
    t = np.array([r["time_us"] for r in rows], dtype=float)
    ax.loglog(n, t, "o", color="tab:blue", ms=4, label="measured all-reduce")
    grid = np.logspace(np.log10(n.min()), np.log10(n.max()), 100)
    f = 2 * (world - 1) / world
    ax.loglog(
        grid,
        1e6 * (fit["alpha"] + f * grid * fit["beta"]),
        "-",
        color="tab:orange",
        label=f"alpha {fit['alpha'] * 1e6:.1f} us + bytes / {fit['busbw_GBps']:.1f} GB/s (busbw)",
    )
    ax.set_xlabel("buffer bytes")
    ax.set_ylabel("time (us)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
