"""crossentropy's contract: the checks of the cross-entropy launchers' arguments (logits (N, V) float32, targets (N,)
int32, the outputs; the half-bits dlogits of crossentropy_forward_backward_half), shared by
kernels/numba/crossentropy.py and gpullm_lessons/backends/hip/crossentropy.py (cupy=True: CuPy arrays only)."""

from gpullm_lessons.contracts import check_array

HALF_FORMATS = ("bf16", "fp16")  # crossentropy_forward_backward_half's half=


def check_inputs(fn, logits, targets, *, cupy=False, **outputs):
    """logits (N, V) float32, targets (N,) int32, outputs losses (N,) / dlogits (N, V) float32, all C-contiguous;
    returns (N, V). cupy=True: CuPy arrays only (the HIP wrappers)."""
    if not hasattr(logits, "shape") or len(logits.shape) != 2:
        raise ValueError(f"{fn}: logits must be 2-D (N, V), got shape {getattr(logits, 'shape', None)}")
    N, V = logits.shape
    check_array(fn, "logits", logits, (N, V), "float32", cupy=cupy)
    check_array(fn, "targets", targets, (N,), "int32", cupy=cupy)
    for name, a in outputs.items():
        check_array(fn, name, a, (N,) if name == "losses" else (N, V), "float32", cupy=cupy)
    return N, V


def check_half_inputs(fn, logits, targets, losses, dlogits, half, cupy=False):
    """crossentropy_forward_backward_half's arguments: dlogits uint16 (N, V), half "bf16" | "fp16". Returns (N, V)."""
    if half not in HALF_FORMATS:
        raise ValueError(f"{fn}: half must be one of {', '.join(HALF_FORMATS)}, got {half!r}")
    if not hasattr(dlogits, "dtype") or str(dlogits.dtype) != "uint16":
        raise TypeError(
            f"{fn}: dlogits must be a uint16 array (the half bits), got "
            f"{getattr(dlogits, 'dtype', type(dlogits).__name__)}"
        )
    N, V = check_inputs(fn, logits, targets, losses=losses, cupy=cupy)
    if tuple(dlogits.shape) != (N, V):
        raise ValueError(f"{fn}: dlogits has shape {tuple(dlogits.shape)}, expected {(N, V)}")
    if not (dlogits.flags.c_contiguous if cupy else dlogits.flags["C_CONTIGUOUS"]):
        raise ValueError(f"{fn}: dlogits must be C-contiguous")
    return N, V
