"""Lesson 08, activation checkpointing: live activation memory through a step, memory saved vs time paid."""

from __future__ import annotations

from .common import figure_and_axes, pyplot


def plot_activation_timeline(timelines: dict, title: str = "", ax=None):
    """Live activation memory through one forward + backward, one line per policy.

    timelines: {policy: [(label, bytes), ...]} as checkpointing.activation_timeline returns (the same points for
    every policy). The forward grows the memory block by block, the backward frees it block by block (the
    sawtooth); "full" keeps only each block's input plus, briefly, one block's recomputed cache."""
    fig, ax = figure_and_axes(ax, figsize=(11, 3.8))
    colors = {"none": "tab:red", "selective": "tab:orange", "full": "tab:green", "sqrt": "tab:purple"}
    labels = None
    for policy, points in timelines.items():
        labels = [lab for lab, _ in points]
        mib = [b / 2**20 for _, b in points]
        ax.step(range(len(points)), mib, where="post", lw=2, color=colors.get(policy), label=policy)
        peak = max(range(len(mib)), key=mib.__getitem__)
        ax.annotate(
            f"peak {mib[peak]:.1f} MiB",
            (peak, mib[peak]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
            color=colors.get(policy),
        )
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
    plt = pyplot()
    fig, ax = figure_and_axes(ax, figsize=(7, 4.2))
    markers = {"none": "o", "selective": "s", "full": "^", "sqrt": "D"}
    cmap = plt.get_cmap("tab10")
    if claim is not None:
        mem, (lo, hi) = claim
        ax.add_patch(plt.Rectangle((lo, mem - 0.1), hi - lo, 0.2, color="gray", alpha=0.2))
        ax.text(
            lo,
            mem + 0.11,
            f"claim: ~{mem:.0%} memory for +{lo - 1:.0%}..{hi - 1:.0%} time",
            fontsize=8,
            color="dimgray",
        )
    for k, (name, points) in enumerate(sources.items()):
        for policy, (mem_rel, time_rel) in points.items():
            ax.scatter(
                time_rel,
                mem_rel,
                marker=markers.get(policy, "x"),
                s=60,
                color=cmap(k % 10),
                label=name if policy == "none" else None,
                zorder=3,
            )
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


def plot_segment_peaks(series: dict, ax=None):
    """The sqrt schedule's predicted activation peak against its segment length k, one line per model.

    series: {label: (rows, marks)}: rows as checkpointing.segment_peaks returns them, marks {name: k} drawn as
    labelled points on that line (e.g. "sqrt(L)", "lowest"). k = 1 is policy "full"; k = L keeps only the
    embedding's output and recomputes the whole model at once."""
    fig, ax = figure_and_axes(ax, figsize=(8, 4))
    for label, (rows, marks) in series.items():
        ks = [r["k"] for r in rows]
        gib = [r["peak"] / 2**30 for r in rows]
        (line,) = ax.plot(ks, gib, marker=".", lw=1.5, label=label)
        for name, k in marks.items():
            y = gib[ks.index(k)]
            ax.scatter([k], [y], s=40, color=line.get_color(), zorder=3)
            ax.annotate(f"{name} (k={k})", (k, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("segment length k (blocks; log scale)")
    ax.set_ylabel("predicted activation peak (GiB)")
    ax.set_title("sqrt schedule: kept segment inputs + one segment's caches", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
