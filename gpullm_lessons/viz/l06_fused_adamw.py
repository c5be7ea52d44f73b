"""Lesson 06, fused AdamW over the flat parameter buffer: the buffer and its decay table, the bytes each
AdamW version moves."""

from __future__ import annotations

from typing import Optional

from .common import pyplot


ADAMW_TRAFFIC = {  # bytes per fp32 parameter, (buffer, "r"/"w", bytes) per kernel, as kernels/numba/adamw.py counts
    "v1 unfused (5 kernels)": [
        ("decay", [("p", "r"), ("g", "r"), ("p", "w"), ("g", "w")]),
        ("m", [("m", "r"), ("g", "r"), ("m", "w")]),
        ("v", [("v", "r"), ("g", "r"), ("v", "w")]),
        ("update", [("p", "r"), ("m", "r"), ("v", "r"), ("p", "w")]),
        ("zero", [("g", "w")]),
    ],
    "v2 fused (1 kernel)": [
        ("fused", [("p", "r"), ("g", "r"), ("m", "r"), ("v", "r"), ("p", "w"), ("m", "w"), ("v", "w"), ("g", "w")])
    ],
    "PyTorch fused + zero_grad": [
        ("fused", [("p", "r"), ("g", "r"), ("m", "r"), ("v", "r"), ("p", "w"), ("m", "w"), ("v", "w")]),
        ("zero_grad", [("g", "w")]),
    ],
}


def plot_param_buffer(param_buffer, decay_names=None, ax=None):
    """The flat parameter buffer (params.ParamBuffer) and its decay table: top, the buffer to scale (one segment per
    named view, green where the tensor decays); below, one box per tensor (equal widths, in buffer order) with its
    name, shape, [start, stop) and its flag: the (bounds, flags) table the fused AdamW kernel reads."""
    plt = pyplot()
    from matplotlib.patches import Patch

    if decay_names is None:
        from ..model.optim import DECAY_NAMES as decay_names
    names = list(param_buffer.names)
    n = int(param_buffer.flat.size)
    k = len(names)
    if ax is None:
        fig, ax = plt.subplots(figsize=(15, 4.4))
    else:
        fig = ax.figure
    col = {True: "tab:green", False: "tab:gray"}
    W = float(k)  # the top bar spans the same width as the k boxes
    for name in names:
        a, b = param_buffer.offsets[name]
        ax.add_patch(
            plt.Rectangle(
                (W * a / n, 3.0),
                W * (b - a) / n,
                0.8,
                facecolor=col[name in decay_names],
                edgecolor="white",
                lw=0.5,
                alpha=0.85,
            )
        )
        if (b - a) / n > 0.06:
            ax.text(W * (a + b) / 2 / n, 3.4, name, ha="center", va="center", fontsize=8, color="white")
    ax.text(0, 3.95, f"params.flat: {n:,} float32 in one buffer (to scale)", fontsize=9)
    for j, name in enumerate(names):
        a, b = param_buffer.offsets[name]
        decays = name in decay_names
        ax.add_patch(
            plt.Rectangle(
                (j + 0.03, 0.0),
                0.94,
                2.0,
                facecolor=col[decays],
                alpha=0.5 if decays else 0.3,
                edgecolor="black",
                lw=0.5,
            )
        )
        shape = "x".join(str(s) for s in param_buffer.shapes[name])
        ax.text(j + 0.5, 1.65, name, ha="center", fontsize=8, weight="bold")
        ax.text(j + 0.5, 1.25, f"({shape})", ha="center", fontsize=6.5)
        ax.text(j + 0.5, 0.85, f"[{a:,},", ha="center", fontsize=6.5)
        ax.text(j + 0.5, 0.55, f"{b:,})", ha="center", fontsize=6.5)
        ax.text(j + 0.5, 0.15, f"flag {int(decays)}", ha="center", fontsize=7.5)
        ax.plot([j + 0.5, W * (a + b) / 2 / n], [2.02, 2.98], color="black", lw=0.4, alpha=0.5)
    ax.legend(
        handles=[
            Patch(color="tab:green", label="decays (flag 1): wte, wpe and the weight matrices"),
            Patch(color="tab:gray", label="no decay (flag 0): biases, LayerNorm weights and biases"),
        ],
        loc="lower center",
        bbox_to_anchor=(0.5, -0.12),
        fontsize=8,
        ncol=2,
        frameon=False,
    )
    ax.set_xlim(-0.1, W + 0.1)
    ax.set_ylim(-0.2, 4.3)
    ax.axis("off")
    ax.set_title(
        "one flat buffer, named views, and the decay table (bounds = the [start, stop) edges, flags)", fontsize=10
    )
    fig.tight_layout()
    return fig


def plot_adamw_bytes(copy_gbps: Optional[float] = None, n_params: int = 124_000_000, ax=None):
    """Bytes moved per fp32 parameter by each AdamW version (stacked: one segment per 4-byte read or write, one
    colour per buffer p, g, m, v; hatched = write; a gap between kernels), and, with copy_gbps, the predicted time
    for n_params at that bandwidth."""
    plt = pyplot()
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
                ax.barh(
                    row,
                    4,
                    left=x,
                    height=0.6,
                    color=colors[buf],
                    edgecolor="white",
                    hatch="//" if rw == "w" else None,
                    alpha=0.85,
                )
                ax.text(x + 2, row, f"{rw} {buf}", ha="center", va="center", fontsize=7, color="white")
                x += 4
            ax.text((x0 + x) / 2, row - 0.33, kernel, ha="center", va="bottom", fontsize=7)
            x += 0.8  # the gap: a kernel boundary, everything goes back to HBM
        total = 4 * sum(len(a) for _, a in ADAMW_TRAFFIC[label])
        note = f"{total} B/param"
        if copy_gbps:
            note += (
                f" -> {total * n_params / (copy_gbps * 1e9) * 1e3:.2f} ms for {n_params / 1e6:.0f}M "
                f"at {copy_gbps:.0f} GB/s"
            )
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
