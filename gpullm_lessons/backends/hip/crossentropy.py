"""Launch wrappers for kernels/hip/crossentropy.cu (CuPy arrays; NVIDIA through NVRTC, AMD through hiprtc).

Same names, signatures and versions as kernels/numba/crossentropy.py (its docstring has the math):
    crossentropy_forward(logits (N,V), targets (N,) int32, losses (N,), version=)
    crossentropy_backward(logits (N,V), targets (N,) int32, dlogits (N,V), version=)   dloss = 1, mean over N
    crossentropy_forward_backward(logits, targets, losses, dlogits, version="v2")     one launch, both outputs
v1: one thread per row. v2: one block per row, shared-memory tree. v3: v2 with warp shuffles.
v4 (backward only, HIP only): v3 with float4 loads/stores when V % 4 == 0 and the arrays are 16-byte aligned (else
v3's scalar loops in the same kernel), 1024 threads per block by default.
"""

from __future__ import annotations

import numpy as np

# the Numba wrapper's checks too (cupy=True: CuPy arrays only)
from gpullm_lessons.contracts.crossentropy import check_half_inputs, check_inputs

VERSIONS = ("v1", "v2", "v3", "v4")
LAUNCHERS = ("crossentropy_forward_backward_half",)  # gathered by backends/_collect.py
FORWARD_VERSIONS = ("v1", "v2", "v3")  # v4 is a backward kernel only
DEFAULT_THREADS = {"v4": 1024}  # others: the threads= default of each function
MAX_THREADS = 1024


def _launch_shape(fn, version, N, threads, allowed=VERSIONS):
    """(grid, block): v1 a thread per row; v2, v3, v4 a block per row (v2: a power of 2, v3, v4: a multiple of 64,
    which is a whole number of warps on NVIDIA (32) and AMD (64))."""
    if version not in allowed:
        raise ValueError(f"{fn}: version={version!r}, expected one of {', '.join(allowed)}")
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"{fn}: threads={threads}, expected 1..{MAX_THREADS}")
    if version == "v1":
        return (N + threads - 1) // threads, threads
    if threads < 64 or threads & (threads - 1):
        raise ValueError(f"{fn}: threads={threads}: {version} needs a power of 2 in [64, {MAX_THREADS}]")
    return N, threads


def _kernel(name):
    from gpullm_lessons.runtime import hip

    return hip.kernel("crossentropy", name)


def crossentropy_backward(logits, targets, dlogits, version="v2", threads=None):
    """dlogits (N,V) = (softmax(logits) - onehot(targets)) / N, for dloss = 1 and the mean loss over N rows.

    threads: per block; None: 1024 for v4, 256 otherwise."""
    N, V = check_inputs("crossentropy_backward", logits, targets, dlogits=dlogits, cupy=True)
    threads = DEFAULT_THREADS.get(version, 256) if threads is None else int(threads)
    grid, block = _launch_shape("crossentropy_backward", version, N, threads)
    if N:
        _kernel(f"crossentropy_backward_{version}")(
            (grid,), (block,), (logits, targets, dlogits, np.int32(N), np.int32(V))
        )
    return dlogits


def crossentropy_forward(logits, targets, losses, version="v2", threads=256):
    """losses (N,) = -log softmax(logits)[target] per row (the mean loss is losses.mean())."""
    N, V = check_inputs("crossentropy_forward", logits, targets, losses=losses, cupy=True)
    grid, block = _launch_shape("crossentropy_forward", version, N, threads, allowed=FORWARD_VERSIONS)
    if N:
        _kernel(f"crossentropy_forward_{version}")(
            (grid,), (block,), (logits, targets, losses, np.int32(N), np.int32(V))
        )
    return losses


def crossentropy_forward_backward(logits, targets, losses, dlogits, version="v2", threads=256):
    """Both in one launch: losses (N,) per row and dlogits (N,V) = (softmax - onehot) / N."""
    N, V = check_inputs("crossentropy_forward_backward", logits, targets, losses=losses, dlogits=dlogits, cupy=True)
    grid, block = _launch_shape("crossentropy_forward_backward", version, N, threads, allowed=("v2",))
    if N:
        _kernel("crossentropy_forward_backward_v2")(
            (grid,), (block,), (logits, targets, losses, dlogits, np.int32(N), np.int32(V))
        )
    return losses, dlogits


HALF_THREADS = 1024  # crossentropy_forward_backward_half: whole warps on either vendor, many bytes in flight


def crossentropy_forward_backward_half(logits, targets, losses, dlogits, half, threads=HALF_THREADS):
    """crossentropy_forward_backward with dlogits (N, V) uint16: the half bits ("bf16" | "fp16", rounded to
    nearest even) of (softmax - onehot) / N, written by the same one-pass kernel (no float32 dlogits). With V % 4 == 0
    and rows on 16 bytes (logits) / 8 bytes (dlogits): the float4 entry point crossentropy_forward_backward_half4_*.

    logits may be float32, or uint16: the half bits of the same format (the head's product rounded them on the way
    out), read by crossentropy_forward_backward_hh_* (hh8_*: 8 per 16-byte load when V % 8 == 0 and both arrays are
    on 16 bytes; else hh4_*: 4 per 8-byte load when V % 4 == 0 and both are on 8 bytes); then dlogits may be logits
    itself (overwritten in place, no second (N, V) buffer)."""
    fn = "crossentropy_forward_backward_half"
    N, V = check_half_inputs(fn, logits, targets, losses, dlogits, half, cupy=True)
    threads = int(threads)
    if threads % 64 or not 64 <= threads <= 1024:
        raise ValueError(
            f"{fn}: threads={threads} must be a multiple of 64 in [64, 1024] (whole warps on NVIDIA and AMD)"
        )
    if N:
        fmt = "bf16" if half == "bf16" else "f16"
        if str(logits.dtype) == "uint16":  # half logits: 16-byte loads of eight, or 8-byte of four, where aligned
            ptrs = (logits.data.ptr, dlogits.data.ptr)
            vec = next((str(k) for k in (8, 4) if V % k == 0 and all(p % (2 * k) == 0 for p in ptrs)), "")
            name = f"crossentropy_forward_backward_hh{vec}_{fmt}"
        else:  # float4 loads / 8-byte half stores when the rows allow them (GPT-2's V = 50304 does), scalar otherwise
            vec = "4" if V % 4 == 0 and logits.data.ptr % 16 == 0 and dlogits.data.ptr % 8 == 0 else ""
            name = f"crossentropy_forward_backward_half{vec}_{fmt}"
        _kernel(name)((N,), (threads,), (logits, targets, losses, dlogits, np.int32(N), np.int32(V)))
    return losses, dlogits
