"""Lesson 00, the GPU orientation: the grid-to-element mapping of a 1-D kernel, the measured ceilings, and
show_kernel (see your own kernel's threads; every later lesson's exercises call it)."""

from __future__ import annotations

from typing import Optional

from .common import figure_and_axes, pyplot


def plot_grid_mapping(n: int, threads_per_block: int, ax=None):
    """Which block and thread own which element of a 1-D array: one cell per element, coloured by block,
    labelled with threadIdx.x; the guard `if i < n` idles the threads past the end (hatched)."""
    plt = pyplot()
    blocks = (n + threads_per_block - 1) // threads_per_block
    total = blocks * threads_per_block
    fig, ax = figure_and_axes(ax, figsize=(min(0.45 * total + 1, 16), 1.9))
    colors = plt.get_cmap("tab10")
    for i in range(total):
        b, t = divmod(i, threads_per_block)
        idle = i >= n
        ax.add_patch(
            plt.Rectangle(
                (i, 0), 0.95, 1, color=colors(b % 10), alpha=0.25 if idle else 0.7, hatch="//" if idle else None
            )
        )
        ax.text(i + 0.47, 0.5, str(t), ha="center", va="center", fontsize=8)
        if t == 0:
            ax.text(i + threads_per_block / 2, 1.15, f"block {b}", ha="center", fontsize=9)
    ax.text(total + 0.2, 0.5, f"n = {n}", va="center", fontsize=9)
    ax.set_xlim(-0.2, total + 2.5)
    ax.set_ylim(-0.5, 1.5)
    ax.axis("off")
    ax.set_title(
        f"{blocks} blocks x {threads_per_block} threads: element i = blockIdx.x * blockDim.x + threadIdx.x "
        f"(hatched: i >= n, idle)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def plot_ceilings(ceilings: dict, ax=None):
    """Bar chart of the measured ceilings (copy GB/s on the left axis, matmul TFLOP/s on the right)."""
    fig, ax = figure_and_axes(ax, figsize=(7, 3.2))
    ax.bar([0], [ceilings["copy"]["GB/s"]], color="tab:blue")
    ax.set_ylabel("copy GB/s", color="tab:blue")
    ax2 = ax.twinx()
    keys = [k for k in ("matmul_fp32", "matmul_fp16", "matmul_bf16") if "TFLOP/s" in ceilings.get(k, {})]
    ax2.bar(range(1, len(keys) + 1), [ceilings[k]["TFLOP/s"] for k in keys], color="tab:orange")
    ax2.set_ylabel("matmul TFLOP/s", color="tab:orange")
    ax.set_xticks(range(len(keys) + 1), ["copy"] + [k.replace("matmul_", "matmul ") for k in keys])
    ax.set_title(f"ceilings of {ceilings['card']} ({ceilings['date']})")
    fig.tight_layout()
    return fig


def show_kernel(fn, *args, op: Optional[str] = None, like=None, case: int = 0, **kw):
    """See your own kernel: run fn(*args) once in the CUDA simulator, print what its threads did and draw it
    (gpullm_lessons.checks.kernel_trace: which thread wrote each output element, loads per thread, shared-memory traffic,
    32-byte sectors per warp load). Use tiny inputs (a few blocks of 32 threads), or instead of arrays pass
    like=check_xxx (the arguments that checker passes on its first, small case; case=k for its k-th) or
    op="softmax_backward" (tiny inputs of an op in kernel_trace.EXAMPLE_DIMS). kw go to kernel_trace.trace
    (warp_size=...).
    Returns the KernelTrace (None for a kernel not written yet). On a GPU it prints one line (tracing runs in the
    simulator only) and runs nothing."""
    from .. import device
    from ..checks import kernel_trace

    if (op is not None) + (like is not None) + bool(args) > 1:
        raise TypeError("show_kernel: pass the arrays, or like=check_..., or op=..., only one of them")
    if device.numba_on_gpu():
        print(f"show_kernel: {kernel_trace.SIM_ONLY}")
        return kernel_trace.trace(fn)
    from ..checks.backward import unfinished_kernel

    stub = unfinished_kernel(fn)
    if stub is not None:
        print(f"show_kernel: not attempted: {stub} still raises NotImplementedError (write it first)")
        return None
    if op is not None:
        args = kernel_trace.example_args(op)
    elif like is not None:
        args = kernel_trace.args_like(like, fn, case=case)
    t = kernel_trace.trace(fn, *args, **kw)
    if not t.available:
        print(f"show_kernel: {t.message}")
        return t
    print(t.summary())
    if t.launches:
        t.plot()
    return t
