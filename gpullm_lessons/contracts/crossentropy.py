"""crossentropy's contract: the checks of the cross-entropy launchers' arguments (logits (N, V) float32, targets (N,)
int32, the outputs; the half-bits dlogits, and the float32 or half-bits logits, of crossentropy_forward_backward_half),
shared by kernels/numba/crossentropy.py and gpullm_lessons/backends/hip/crossentropy.py (cupy=True: CuPy arrays only)."""

from gpullm_lessons.contracts import check_array

HALF_FORMATS = ("bf16", "fp16")  # crossentropy_forward_backward_half's half=


def check_inputs(fn, logits, targets, *, cupy=False, logits_dtype="float32", **outputs):
    """logits (N, V) float32 (or logits_dtype), targets (N,) int32, outputs losses (N,) / dlogits (N, V) float32, all
    C-contiguous; returns (N, V). cupy=True: CuPy arrays only (the HIP wrappers)."""
    if not hasattr(logits, "shape") or len(logits.shape) != 2:
        raise ValueError(f"{fn}: logits must be 2-D (N, V), got shape {getattr(logits, 'shape', None)}")
    N, V = logits.shape
    check_array(fn, "logits", logits, (N, V), logits_dtype, cupy=cupy)
    check_array(fn, "targets", targets, (N,), "int32", cupy=cupy)
    for name, a in outputs.items():
        check_array(fn, name, a, (N,) if name == "losses" else (N, V), "float32", cupy=cupy)
    return N, V


def check_half_inputs(fn, logits, targets, losses, dlogits, half, cupy=False):
    """crossentropy_forward_backward_half's arguments: dlogits uint16 (N, V), half "bf16" | "fp16"; logits float32
    (N, V), or uint16 (N, V): the half bits of the same format (dlogits may then be the logits array itself, written
    in place). Returns (N, V)."""
    if half not in HALF_FORMATS:
        raise ValueError(f"{fn}: half must be one of {', '.join(HALF_FORMATS)}, got {half!r}")
    if not hasattr(dlogits, "dtype") or str(dlogits.dtype) != "uint16":
        raise TypeError(
            f"{fn}: dlogits must be a uint16 array (the half bits), got "
            f"{getattr(dlogits, 'dtype', type(dlogits).__name__)}"
        )
    dtype = str(getattr(logits, "dtype", "float32"))
    if dtype not in ("float32", "uint16"):
        raise TypeError(f"{fn}: logits has dtype {dtype}, expected float32 or uint16 (the {half} bits, as dlogits)")
    N, V = check_inputs(fn, logits, targets, losses=losses, cupy=cupy, logits_dtype=dtype)
    if tuple(dlogits.shape) != (N, V):
        raise ValueError(f"{fn}: dlogits has shape {tuple(dlogits.shape)}, expected {(N, V)}")
    if not (dlogits.flags.c_contiguous if cupy else dlogits.flags["C_CONTIGUOUS"]):
        raise ValueError(f"{fn}: dlogits must be C-contiguous")
    return N, V
