"""Lesson 12, memory at scale: where a step's bytes go (the engine's memory model), and loss curves side by side."""

from __future__ import annotations

from .common import figure_and_axes


def format_memory_terms(rows: dict) -> str:
    """A table of engine.engine_memory results: rows {label: engine_memory(...) dict}, one column each, GiB."""
    keys = [
        ("params", "parameters (fp32 master)"),
        ("params_half", "half copy of the weights"),
        ("grads", "gradients (fp32)"),
        ("adamw", "AdamW m and v (fp32)"),
        ("activations", "activations kept for backward"),
        ("working_set", "largest working set of a phase"),
        ("total", "total (predicted peak)"),
    ]
    labels = list(rows)
    lines = [f"{'GiB':<34}" + "".join(f"{label:>18}" for label in labels)]
    for key, what in keys:
        lines.append(f"{what:<34}" + "".join(f"{rows[label][key] / 2**30:18.3f}" for label in labels))
    return "\n".join(lines)


def plot_loss_curves(curves: dict, ax=None, title: str = ""):
    """Loss against step for each labelled list of losses (one line each)."""
    fig, ax = figure_and_axes(ax, (6.4, 3.4))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
