"""Lesson 09, the full training loop: the loss curve (also drawn by the training script, train.py, and by
lesson 10), one step as a pipeline, the live loss plot, where a step's time goes, the step timeline, ours vs
PyTorch."""

from __future__ import annotations

from typing import Iterable, Optional

from .common import pyplot


def plot_loss(log_records: Iterable[dict], path=None, entropy: Optional[float] = None, ax=None):
    """Train loss per step, val loss where evaluated, and the byte-unigram entropy line; returns the figure.

    log_records: dicts with "step" and "loss", and "val_loss" on evaluation steps (the lines of log.jsonl).
    path: also save the figure there (PNG). entropy: draw it as the bar to beat (nats per byte).
    ax: draw into this matplotlib Axes instead of a new figure.
    """
    records = list(log_records)
    if ax is None:
        fig, ax = pyplot().subplots(figsize=(7, 4))
    else:
        fig = ax.figure
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.8, label="train loss (one batch)")
    if val:
        ax.plot(*zip(*val), "o-", lw=2, label="val loss (held-out 10%)")
    if entropy is not None:
        ax.axhline(entropy, color="gray", ls="--", lw=1, label=f"byte-unigram entropy {entropy:.3f} (the bar to beat)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("GPT training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def plot_training_step(n_layer="L", ax=None):
    """One training step as a pipeline of boxes, each labelled with the lesson that built its kernel: the forward
    (batch -> embed -> n_layer blocks -> lnf -> head -> fused cross-entropy), one block opened up below it (LN, qkv
    matmul, attention, proj, LN, fc, GELU, proj), then the backward in reverse order, the global gradient norm and
    the fused AdamW with its half copy."""
    plt = pyplot()
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    if ax is None:
        fig, ax = plt.subplots(figsize=(13, 5.4))
    else:
        fig = ax.figure
    colors = {"data": "#d9d9d9", "fwd": "#c6dbef", "loss": "#fdd0a2", "bwd": "#fcbba1", "opt": "#c7e9c0"}

    def box(x, y, w, text, kind, lesson="", h=0.62):
        ax.add_patch(
            FancyBboxPatch(
                (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=colors[kind], ec="black", lw=0.8
            )
        )
        ax.text(x + w / 2, y + h / 2 + (0.07 if lesson else 0), text, ha="center", va="center", fontsize=8.5)
        if lesson:
            ax.text(x + w / 2, y + 0.1, lesson, ha="center", va="center", fontsize=6.5, color="dimgray")
        return (x, y, w, h)

    def arrow(a, b, dy=0.0):
        ax.add_patch(
            FancyArrowPatch(
                (a[0] + a[2], a[1] + a[3] / 2 + dy),
                (b[0], b[1] + b[3] / 2 + dy),
                arrowstyle="-|>",
                mutation_scale=9,
                lw=0.8,
                color="black",
            )
        )

    # row 1: the forward of the whole model
    y1 = 4.0
    row1 = [
        ("batch x, y\n(B, T) int32", "data", "L09 data", 1.5),
        ("embed\nwte[x] + wpe", "fwd", "L05", 1.4),
        (f"{n_layer} blocks", "fwd", "below", 1.6),
        ("lnf\nLayerNorm", "fwd", "L04", 1.3),
        ("head\nlnf @ wte.T", "fwd", "L02 cuBLAS", 1.5),
        ("fused CE\nloss, dlogits", "loss", "L05", 1.6),
    ]
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
    row2 = [
        ("LN1", "L04", 0.8),
        ("qkv\nmatmul", "L02", 0.95),
        ("attention\nq k^T, softmax, @v", "L03 L05", 1.75),
        ("proj\n+ residual", "L02", 1.1),
        ("LN2", "L04", 0.8),
        ("fc\nmatmul", "L02", 0.95),
        ("GELU", "L05", 0.85),
        ("proj\n+ residual", "L02", 1.1),
    ]
    x, prev, first = 0.9, None, None
    for text, lesson, w in row2:
        b = box(x, y2, w, text, "fwd", lesson)
        if prev:
            arrow(prev, b)
        first = first or b
        prev, x = b, x + w + 0.3
    blk = boxes1[2]
    ax.plot([blk[0], first[0] - 0.1, first[0] - 0.1], [y1, y1 - 0.35, y2 + 0.62 + 0.1], color="gray", lw=0.8, ls=":")
    ax.plot(
        [blk[0] + blk[2], prev[0] + prev[2] + 0.1, prev[0] + prev[2] + 0.1],
        [y1, y1 - 0.35, y2 + 0.62 + 0.1],
        color="gray",
        lw=0.8,
        ls=":",
    )
    ax.text(
        prev[0] + prev[2] + 0.25,
        y2 + 0.31,
        f"one block, x {n_layer}\n(checkpointing L08:\nrecompute, not keep)",
        fontsize=7.5,
        color="dimgray",
        va="center",
    )
    first_bwd = None
    # row 3, right to left: the backward in reverse order, the global norm, AdamW
    y3 = 1.0
    row3 = [
        ("backward of CE\n+ head (dlogits)", "bwd", "L05 L02", 1.75),
        (f"blocks {n_layer} .. 1\nin reverse", "bwd", "L02-L05", 1.6),
        ("embed backward\ndwte, dwpe", "bwd", "L05", 1.7),
        ("global norm\n||g||, one reduction", "opt", "L09", 1.9),
        ("clip coef\nmin(1, c/||g||)", "opt", "L09", 1.6),
        ("fused AdamW\n(+ half copy)", "opt", "L06 L07", 1.6),
    ]
    x, prev = 13.55, None
    for text, kind, lesson, w in row3:
        x -= w
        b = box(x, y3, w, text, kind, lesson)
        if prev:
            ax.add_patch(
                FancyArrowPatch(
                    (prev[0], y3 + 0.31),
                    (b[0] + b[2], y3 + 0.31),
                    arrowstyle="-|>",
                    mutation_scale=9,
                    lw=0.8,
                    color="black",
                )
            )
        prev, x = b, x - 0.35
        if kind == "bwd" and first_bwd is None:
            first_bwd = b
    ax.text(
        prev[0],
        y3 - 0.28,
        "<- backward in reverse order, then the update (right to left)",
        fontsize=8.5,
        color="tab:red",
        va="center",
    )
    ce = boxes1[-1]
    xr = 13.9
    ax.plot([ce[0] + ce[2], xr, xr], [y1 + 0.31, y1 + 0.31, y3 + 0.31], color="tab:red", lw=0.9, ls="--")
    ax.add_patch(
        FancyArrowPatch(
            (xr, y3 + 0.31),
            (first_bwd[0] + first_bwd[2], y3 + 0.31),
            arrowstyle="-|>",
            mutation_scale=9,
            lw=0.9,
            color="tab:red",
            ls="--",
        )
    )
    ax.set_xlim(0, 14.2)
    ax.set_ylim(0.35, 4.95)
    ax.axis("off")
    ax.legend(
        handles=[
            Patch(fc=c, ec="black", label=k)
            for k, c in (
                ("data", colors["data"]),
                ("forward", colors["fwd"]),
                ("loss", colors["loss"]),
                ("backward", colors["bwd"]),
                ("optimizer", colors["opt"]),
            )
        ],
        loc="upper right",
        bbox_to_anchor=(1.0, 0.08),
        fontsize=7.5,
        ncol=5,
        frameon=False,
    )
    ax.set_title("one training step, and the lesson (L02..L08) that built each kernel", fontsize=10)
    fig.tight_layout()
    return fig


class LiveLossPlot:
    """A loss plot that redraws in place in a notebook while a loop runs (an IPython display handle).

        live = LiveLossPlot(entropy=h)        # shows an empty figure under the cell
        live.update(records)                  # redraw with plot_loss(records); call it every k steps
    Outside IPython (a script, a test) update() only redraws the figure (self.fig), it displays nothing."""

    def __init__(self, entropy: Optional[float] = None, title: str = "GPT training loss (live)"):
        plt = pyplot()
        self.entropy, self.title = entropy, title
        self.fig, self.ax = plt.subplots(figsize=(7, 4))
        plt.close(self.fig)  # not shown again at the end of the cell: the handle shows it
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
    plt = pyplot()
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
    ax.set_title(
        title
        or f"{result.get('preset', '')} {result.get('precision', '')} on {result.get('card', '?')}: "
        f"{result['step_ms']:.3g} ms per step",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_step_timeline(result: dict, axes=None):
    """One traced training step launched from Python ("eager") above the same step replayed as a CUDA graph
    ("graph"), on one time axis (profiling.step_timeline's dict): per step, the CPU's launch calls and the GPU's
    kernels (cuBLAS products in blue, the course's kernels in orange, CuPy's in grey); the gaps in the GPU lane are
    the GPU waiting."""
    from ..bench.profiling import kernel_family

    plt = pyplot()
    modes = [m for m in ("eager", "graph") if result.get(m)]
    if axes is None:
        fig, axes = plt.subplots(len(modes), 1, figsize=(9, 1.5 * len(modes) + 0.8), sharex=True, squeeze=False)
        axes = axes[:, 0]
    fig = axes[0].figure
    span = (
        max(
            e["ts"] + e["dur"]
            for m in modes
            for e in result[m]["events"]
            if e["kind"] in ("kernel", "memcpy", "memset")
        )
        / 1e3
    )
    colors = {"gemm (cuBLAS)": "tab:blue", "CuPy elementwise / reduction": "tab:gray"}
    for ax, mode in zip(axes, modes):
        ev = result[mode]["events"]
        launches = [
            (e["ts"] / 1e3, max(e["dur"] / 1e3, span / 2000))
            for e in ev
            if e["kind"] == "runtime" and "aunch" in e["name"]
        ]
        ax.broken_barh(launches, (1.1, 0.8), color="tab:green")
        kernels = [e for e in ev if e["kind"] == "kernel"]
        for fam_color in ("tab:orange", "tab:gray", "tab:blue"):  # cuBLAS drawn last: thin bars stay visible
            bars = [
                (e["ts"] / 1e3, max(e["dur"] / 1e3, span / 2000))
                for e in kernels
                if colors.get(kernel_family(e["name"]), "tab:orange") == fam_color
            ]
            ax.broken_barh(bars, (0.1, 0.8), color=fam_color)
        m = result[mode]
        ax.set_yticks([0.5, 1.5], ["GPU kernels", "CPU launches"], fontsize=8)
        ax.set_ylim(0, 2)
        ax.set_xlim(0, span * 1.01)
        ax.set_title(
            f"{mode}: {m['kernels']} kernels, GPU busy {m['gpu_busy_us'] / 1e3:.2f} ms of a "
            f"{m['span_us'] / 1e3:.2f} ms step",
            fontsize=9,
        )
    axes[-1].set_xlabel("ms from the start of the step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange", "tab:gray", "tab:green")]
    axes[0].legend(
        handles,
        ["cuBLAS", "course kernels", "CuPy", "launch call"],
        fontsize=7,
        ncol=4,
        loc="upper right",
        bbox_to_anchor=(1, 1.55),
    )
    fig.suptitle(
        f"{result['preset']} B{result['B']} T{result['T']} {result['precision']}, {result['card']} ({result['date']})",
        fontsize=10,
        y=1.0,
    )
    fig.tight_layout()
    return fig


def plot_train_bench(result: dict, axes=None):
    """Step time of our engine beside PyTorch eager (bench_train.bench_train's dict): one panel per preset, a pair
    of bars per precision, each labelled with its ms and our time / PyTorch's time."""
    plt = pyplot()
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
                ax.bar(
                    i + (j - (len(whos) - 1) / 2) * width,
                    ms,
                    width,
                    color=who_color.get(who, f"C{j + 2}"),
                    label=who if i == 0 else None,
                )
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
    fig.suptitle(
        f"training step: ours vs PyTorch eager, {result.get('card', '?')} ({result.get('date', '?')})", fontsize=10
    )
    fig.tight_layout()
    return fig
