"""Lesson 07, mixed precision: the float formats' bits (a figure, an HTML table, a widget), gradients against
fp16's range, the dynamic loss scale, the losses under each matmul precision."""

from __future__ import annotations

from typing import Optional

from .common import pyplot


def plot_float_formats(ax=None):
    """The bit layouts of fp32, TF32, fp16 and bf16 (sign, exponent, mantissa boxes, one per bit) with each format's
    largest value, smallest normal and subnormal, and machine epsilon. TF32 is what tensor cores read of an fp32
    input in an fp32 matmul (cuBLAS's TF32 mode): fp32's sign and 8 exponent bits and the top 10 mantissa bits."""
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle

    fmts = [("fp32", 8, 23), ("tf32", 8, 10), ("fp16", 5, 10), ("bf16", 8, 7)]
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 4.0))
    else:
        fig = ax.figure
    colors = {"sign": "tab:red", "exponent": "tab:green", "mantissa": "tab:blue"}
    for row, (name, e, m) in enumerate(fmts):
        y = -row * 1.2
        kinds = ["sign"] + ["exponent"] * e + ["mantissa"] * m
        for i, kind in enumerate(kinds):
            ax.add_patch(Rectangle((i, y), 0.92, 0.8, color=colors[kind], alpha=0.75))
        if name == "tf32":  # the 13 low bits of the fp32 word that the tensor core ignores
            for i in range(len(kinds), 32):
                ax.add_patch(Rectangle((i, y), 0.92, 0.8, facecolor="none", edgecolor="0.5", ls=":"))
        bias = 2 ** (e - 1) - 1
        largest = (2 - 2.0**-m) * 2.0**bias
        info = (
            f"{name}: 1 + {e} + {m} bits | max {largest:.4g} | min normal 2^{1 - bias} = {2.0 ** (1 - bias):.2g} | "
            f"min subnormal 2^{1 - bias - m} = {2.0 ** (1 - bias - m):.2g} | eps 2^-{m} = {2.0**-m:.2g}"
        )
        ax.text(0, y + 0.88, info, fontsize=8.5, va="bottom")
    handles = [Patch(color=c, alpha=0.75, label=k) for k, c in colors.items()]
    handles.append(Patch(facecolor="none", edgecolor="0.5", ls=":", label="tf32: the fp32 bits a tensor core ignores"))
    ax.legend(handles=handles, loc="lower right", fontsize=8, ncol=4)
    ax.set_xlim(-0.5, 33)
    ax.set_ylim(-(len(fmts) - 1) * 1.2 - 0.9, 1.4)
    ax.axis("off")
    ax.set_title(
        "bf16 keeps fp32's 8 exponent bits (its range), fp16 keeps more mantissa (its precision); TF32, "
        "what tensor cores read of fp32 in an fp32 matmul, has both",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def float_formats_html(value: float) -> str:
    """An HTML table of how `value` is stored in fp32, fp16, bf16 (precision.format_rows) and TF32: one column
    each for the sign, exponent and mantissa bits (monospace, so the bits line up), the hex word, the value the
    format holds and the relative error."""
    import html

    from ..model.precision import format_rows, tf32_row

    rows = format_rows(value) + [tf32_row(value)]
    mono = "font-family: var(--jp-code-font-family, monospace); white-space: pre;"
    cell = f"padding: 1px 8px; text-align: left; {mono}"
    head = "".join(
        f'<th style="padding: 1px 8px; text-align: {a}">{h}</th>'
        for h, a in (
            ("format", "left"),
            ("sign", "left"),
            ("exponent", "left"),
            ("mantissa", "left"),
            ("hex", "left"),
            ("stored value", "right"),
            ("rel. error", "right"),
        )
    )
    body = []
    for r in rows:
        sign, exponent, mantissa = r["bits"].split()
        tds = [
            (r["name"], "left"),
            (sign, "left"),
            (exponent, "left"),
            (mantissa, "left"),
            (r["hex"], "left"),
            (f"{r['stored']:.10g}", "right"),
            (f"{r['rel_err']:.2e}", "right"),
        ]
        body.append(
            "<tr>" + "".join(f'<td style="{cell} text-align: {a}">{html.escape(t)}</td>' for t, a in tds) + "</tr>"
        )
    return (
        f'<div style="{mono}">value {html.escape(repr(float(value)))}</div>'
        f'<table style="border-collapse: collapse"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def float_formats_widget(value: float = 0.1):
    """An ipywidgets box: type a value, or move the slider (log10 of |value|), and see its fp32, fp16, bf16 and
    TF32 bits, the value each format stores and the relative error (float_formats_html). The text box and the
    slider follow each other. Needs a widget frontend."""
    import math

    import ipywidgets as widgets

    lo, hi, step = -9.0, 6.0, 0.05
    box = widgets.FloatText(value=value, description="value", step=0.1)
    exp = widgets.FloatSlider(
        value=0.0, min=lo, max=hi, step=step, description="or 10^", continuous_update=True, readout_format=".2f"
    )
    out = widgets.HTML()
    syncing = []  # non-empty while one control sets the other: no echo back

    def show(*_):
        out.value = float_formats_html(box.value)

    def to_slider(value):
        if value != 0 and math.isfinite(value):
            exp.value = min(hi, max(lo, round(math.log10(abs(value)) / step) * step))

    def from_box(change):
        show()
        if not syncing:
            syncing.append(1)
            try:
                to_slider(change["new"])
            finally:
                syncing.clear()

    def from_slider(change):
        if syncing:
            return
        syncing.append(1)
        try:
            sign = -1.0 if box.value < 0 else 1.0
            box.value = sign * float(f"{10.0 ** change['new']:.6g}")
        finally:
            syncing.clear()

    box.observe(from_box, names="value")
    exp.observe(from_slider, names="value")
    syncing.append(1)  # the slider starts at the value's log10, the value itself stays as given
    to_slider(value)
    syncing.clear()
    show()
    return widgets.VBox([widgets.HBox([box, exp]), out])


def plot_grad_histogram(grads, scale: float = 2.0**16, ax=None):
    """Histogram of log2|g| of a gradient (nonzero elements), unscaled and multiplied by `scale`, with the fp16
    limits marked: 2^-24 (smallest subnormal: below about half of it a value rounds to 0), 2^-14 (smallest
    normal: below it precision drops), 65504 (largest: above it inf). The legend gives the fraction of the nonzero
    elements that round to 0 in fp16, without and with the scale."""
    import numpy as np

    plt = pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 3.8))
    else:
        fig = ax.figure
    g = np.asarray(grads, dtype=np.float32).ravel()
    g = g[g != 0]
    with np.errstate(over="ignore"):
        flushed = float(np.mean(g.astype(np.float16) == 0))
        flushed_s = float(np.mean((g * np.float32(scale)).astype(np.float16) == 0))
        over_s = float(np.mean(~np.isfinite((g * np.float32(scale)).astype(np.float16))))
    lg = np.log2(np.abs(g).astype(np.float64))
    bins = np.arange(np.floor(lg.min()) - 1, np.ceil(lg.max() + np.log2(scale)) + 2, 0.5)
    ax.hist(lg, bins=bins, alpha=0.6, color="tab:blue", label=f"g (unscaled): {100 * flushed:.2f}% round to 0 in fp16")
    ax.hist(
        lg + np.log2(scale),
        bins=bins,
        alpha=0.5,
        color="tab:orange",
        label=f"g x 2^{np.log2(scale):.0f}: {100 * flushed_s:.4f}% round to 0, {100 * over_s:.4f}% overflow",
    )
    ax.axvspan(bins[0], -25, color="tab:red", alpha=0.12)
    for x, text in (
        (-24, "2^-24 smallest subnormal"),
        (-14, "2^-14 smallest normal"),
        (np.log2(65504.0), "65504 largest fp16"),
    ):
        ax.axvline(x, color="tab:red", ls="--", lw=1)
        ax.text(x + 0.2, ax.get_ylim()[1] * 0.95, text, rotation=90, va="top", fontsize=8, color="tab:red")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("elements")
    ax.set_title("gradient magnitudes against fp16's range (shaded: rounds to zero)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_loss_scale(scales, skipped=(), ax=None):
    """The loss scale used at each step (log2 axis), overflowing steps (skipped, then the scale halves) marked."""
    import numpy as np

    plt = pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 3))
    else:
        fig = ax.figure
    steps = np.arange(1, len(scales) + 1)
    ax.step(steps, np.log2(scales), where="post", color="tab:purple", label="log2 scale")
    sk = [s for s in skipped if 1 <= s <= len(scales)]
    if sk:
        ax.plot(sk, [np.log2(scales[s - 1]) for s in sk], "rx", ms=8, label=f"overflow: step skipped ({len(sk)})")
    ax.set_xlabel("step")
    ax.set_ylabel("log2(loss scale)")
    ax.set_title("dynamic loss scaling: halve on overflow, double after growth_interval clean steps", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_precision_losses(result: dict, rtol: Optional[float] = None, reference: str = "fp32"):
    """Top: the training loss per step of each run of precision.compare_precisions(...), each with its own line
    style and markers (runs that track the reference lie on top of it; the markers show them). Bottom: each run's
    |loss - reference loss| / reference loss on a log scale, so a run 1e-5 and one 30% away both stay readable,
    with the tracking tolerance rtol as a line (below it: tracks)."""
    import numpy as np

    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    ref = np.asarray(result[reference]["loss"], dtype=np.float64)
    steps = np.arange(1, len(ref) + 1)
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 2)), "P")]
    every = max(1, len(ref) // 10)
    floor = 1e-8  # |deviation| 0 (bit-identical losses) is drawn here on the log axis
    for i, (name, run) in enumerate(result.items()):
        loss = np.asarray(run["loss"], dtype=np.float64)
        ls, marker = styles[i % len(styles)]
        label = name + (f" ({len(run['skipped'])} skipped)" if run.get("skipped") else "")
        kw = dict(color=f"C{i}", ls=ls, marker=marker, ms=4, markevery=(i * every // max(1, len(result)), every))
        if name == reference:
            top.plot(steps, loss, lw=2.5, alpha=0.5, label=f"{label} (reference)", **kw)
            continue
        dev = np.abs(loss - ref) / ref
        top.plot(steps, loss, lw=1.2, label=f"{label}: max |rel. dev.| {dev.max():.1e}", **kw)
        bottom.plot(steps, np.maximum(dev, floor), lw=1, label=name, **kw)
    bottom.set_yscale("log")
    lo, hi = bottom.get_ylim()
    if rtol is not None:
        bottom.axhline(rtol, color="tab:green", lw=1.2, label=f"tolerance {rtol:g}")
        bottom.axhspan(floor / 10, rtol, color="tab:green", alpha=0.08)
        lo, hi = min(lo, rtol / 10), max(hi, rtol * 10)
    bottom.set_ylim(max(lo, floor / 2), hi)
    top.set_ylabel("loss (nats per byte)")
    top.set_title("the same model, init and batches under each matmul precision", fontsize=10)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"|loss - {reference}| / {reference}")
    bottom.legend(fontsize=8, ncol=4, loc="lower right")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    return fig
