"""Matrix products for the training loop: cuBLAS / hipBLAS through CuPy, fp32 or half inputs, fp32 accumulation.

    gemm(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, fmt="fp32")
        out = alpha * op(a) @ op(b) + beta * out        (row-major, C-contiguous; op(x) = x.T when trans_x)
        a, b: (M, K) / (K, N) after op, or batched (G, M, K) / (G, K, N) with out (G, M, N).
        fmt:  "fp32"  a, b float32, computed in fp32 (no TF32: the results match NumPy to ~1e-6)
              "tf32"  a, b float32 read as TF32 by the tensor cores (10 mantissa bits), accumulated in fp32, out
                      float32 (NVIDIA's cuBLAS: CUBLAS_COMPUTE_32F_FAST_TF32; on NumPy arrays the inputs are rounded
                      to TF32 first, reference/rounding.py)
              "fp16"  a, b float16 (or their uint16 bits), products accumulated in fp32, out float32
              "bf16"  a, b uint16 holding bfloat16 bits, products accumulated in fp32, out float32
        out:  float32; in fp16 / bf16 also the half format itself (float16 or uint16 bits; bf16: uint16), so that
              cuBLAS rounds the fp32 result to half on the way out (the accumulation stays fp32)

Why one function around cublasGemmStridedBatchedEx instead of ``cupy.matmul``: CuPy's matmul returns the input
dtype (a half product would be rounded to half), has no alpha/beta (the loss scale and the 1/sqrt(hs) of attention
fold into alpha for free), and knows no bfloat16 bits. cuBLAS is column-major; a row-major (M, N) array is the
column-major (N, M) matrix, so out.T = op(b).T @ op(a).T is computed by passing b first: no copies.

On NumPy arrays (the Numba backend in the CUDA simulator, the tests) the same call runs with NumPy: half inputs are
widened to float32 and multiplied in float32, which is what the GPU computes up to the order of the sums.
"""
from __future__ import annotations

import numpy as np

FORMATS = ("fp32", "tf32", "fp16", "bf16")
_HALF_STORAGE = {"fp32": ("float32",), "tf32": ("float32",), "fp16": ("float16", "uint16"), "bf16": ("uint16",)}
_CUBLAS_COMPUTE_32F_FAST_TF32 = 77  # cublasComputeType_t (cublas_api.h), when CuPy does not name it


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _to_f32(x, fmt, xp):
    if fmt == "fp32":
        return x
    if fmt == "tf32":
        from ..reference.rounding import round_to
        return round_to(x, "tf32")
    if fmt == "fp16":
        return (x.view(xp.float16) if x.dtype == xp.uint16 else x).astype(xp.float32)
    return (x.astype(xp.uint32) << 16).view(xp.float32)          # bf16 bits -> the float32 with those top bits


def _store_half(x, out, fmt):
    """x float32 -> out (uint16 bits, or float16) rounded to nearest even, as the GPU's half output."""
    from ..model.precision import f32_to_bf16_bits
    if fmt == "bf16":
        out[...] = f32_to_bf16_bits(x)
    else:
        out[...] = x.astype(np.float16).view(out.dtype) if str(out.dtype) == "uint16" else x.astype(np.float16)


def _check(a, b, out, trans_a, trans_b, fmt):
    if fmt not in FORMATS:
        raise ValueError(f"gemm: fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    for name, x in (("a", a), ("b", b)):
        if str(x.dtype) not in _HALF_STORAGE[fmt]:
            raise TypeError(f"gemm: {name} is {x.dtype}; fmt={fmt!r} needs {' or '.join(_HALF_STORAGE[fmt])}")
    if str(out.dtype) != "float32" and (fmt in ("fp32", "tf32") or str(out.dtype) not in _HALF_STORAGE[fmt]):
        raise TypeError(f"gemm: out must be float32 (fp32 accumulation){'' if fmt in ('fp32', 'tf32') else ' or ' + ' / '.join(_HALF_STORAGE[fmt])}"
                        f", got {out.dtype}")
    if not (a.ndim == b.ndim == out.ndim and a.ndim in (2, 3)):
        raise ValueError(f"gemm: a, b, out must all be 2-D or all 3-D (batched), got {a.shape}, {b.shape}, {out.shape}")
    for name, x in (("a", a), ("b", b), ("out", out)):
        if not x.flags.c_contiguous:
            raise ValueError(f"gemm: {name} must be C-contiguous (row-major), got strides {x.strides}")
    M, K = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
    K2, N = (b.shape[-1], b.shape[-2]) if trans_b else b.shape[-2:]
    G = a.shape[0] if a.ndim == 3 else 1
    if K != K2 or out.shape[-2:] != (M, N) or (a.ndim == 3 and not (b.shape[0] == out.shape[0] == G)):
        raise ValueError(f"gemm: shapes do not chain: op(a) {(M, K)}, op(b) {(K2, N)}, out {tuple(out.shape)} "
                         f"(trans_a={trans_a}, trans_b={trans_b}, batch {G})")
    return G, M, N, K


def gemm(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, fmt="fp32"):
    """out = alpha * op(a) @ op(b) + beta * out; see the module docstring. Returns out."""
    G, M, N, K = _check(a, b, out, trans_a, trans_b, fmt)
    if not _is_cupy(out):
        if not (type(a) is type(b) is type(out)):
            raise TypeError("gemm: a, b and out must all be NumPy arrays or all CuPy arrays")
        af, bf = _to_f32(a, fmt, np), _to_f32(b, fmt, np)
        af = np.swapaxes(af, -1, -2) if trans_a else af
        bf = np.swapaxes(bf, -1, -2) if trans_b else bf
        prod = np.matmul(af, bf)
        if alpha != 1.0:
            prod *= np.float32(alpha)
        if str(out.dtype) != "float32":                  # a half output: fp32 result, then rounded to half
            if beta != 0.0:
                prod += np.float32(beta) * _to_f32(out, fmt, np)
            _store_half(prod.astype(np.float32), out, fmt)
            return out
        if beta == 0.0:
            out[...] = prod
        else:
            out *= np.float32(beta)
            out += prod
        return out
    import cupy as cp
    from cupy.cuda import device, runtime
    from cupy_backends.cuda.libs import cublas

    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, cp.ndarray):
            raise TypeError(f"gemm: {name} is a {type(x).__name__}, out is a CuPy array: use CuPy arrays for all")
        if x.device.id != out.device.id:
            raise ValueError(f"gemm: {name} is on GPU {x.device.id}, out on GPU {out.device.id}")
    if G == 0 or M == 0 or N == 0:
        return out
    if K == 0:                                           # an empty product: out = beta * out
        if str(out.dtype) == "float32":
            out *= np.float32(beta)
        elif beta == 0.0:
            out.fill(0)
        else:
            raise ValueError("gemm: K = 0 with beta != 0 and a half output is not supported")
        return out
    if fmt == "tf32" and runtime.is_hip:
        raise ValueError("gemm: fmt='tf32' is cuBLAS's TF32 mode (NVIDIA); on AMD use fmt='fp32'")
    dtype = {"fp32": runtime.CUDA_R_32F, "tf32": runtime.CUDA_R_32F, "fp16": runtime.CUDA_R_16F,
             "bf16": runtime.CUDA_R_16BF}[fmt]
    compute = _compute_type(fmt)
    out_type = runtime.CUDA_R_32F if str(out.dtype) == "float32" else dtype
    alpha_h, beta_h = np.array(alpha, np.float32), np.array(beta, np.float32)
    lda, ldb = a.shape[-1], b.shape[-1]                 # row length of the stored (row-major) arrays
    op = {False: cublas.CUBLAS_OP_N, True: cublas.CUBLAS_OP_T}
    # column-major view: out.T (N, M) = op(b).T (N, K) @ op(a).T (K, M): b goes first
    stream = cp.cuda.get_current_stream()
    if not runtime.is_hip and _capturing(stream):
        # CuPy refuses cuBLAS calls while a stream is being captured; cuBLAS itself supports capture (given a
        # workspace of its own): call it directly on our own handle
        return _captured_gemm(stream, op[trans_b], op[trans_a], N, M, K, alpha_h, b, dtype, ldb,
                              (b.shape[-2] * b.shape[-1]) if b.ndim == 3 else 0, a, lda,
                              (a.shape[-2] * a.shape[-1]) if a.ndim == 3 else 0, beta_h, out, G, out_type,
                              compute)
    cublas.gemmStridedBatchedEx(
        device.get_cublas_handle(), op[trans_b], op[trans_a], N, M, K,
        alpha_h.ctypes.data,
        b.data.ptr, dtype, ldb, (b.shape[-2] * b.shape[-1]) if b.ndim == 3 else 0,
        a.data.ptr, dtype, lda, (a.shape[-2] * a.shape[-1]) if a.ndim == 3 else 0,
        beta_h.ctypes.data,
        out.data.ptr, out_type, N, M * N,
        G, compute, cublas.CUBLAS_GEMM_DEFAULT)
    return out


def _compute_type(fmt):
    """cuBLAS's compute type for fmt: fp32 accumulation, with the inputs read as TF32 in "tf32"."""
    from cupy_backends.cuda.libs import cublas
    if fmt == "tf32":
        return getattr(cublas, "CUBLAS_COMPUTE_32F_FAST_TF32", _CUBLAS_COMPUTE_32F_FAST_TF32)
    return cublas.CUBLAS_COMPUTE_32F


def _capturing(stream) -> bool:
    """Whether CuPy's current stream is being captured into a CUDA graph (the null stream never is)."""
    return bool(stream.ptr) and bool(stream.is_capturing())


# ---- cuBLAS inside a CUDA graph capture -------------------------------------------------------------------------
WORKSPACE_BYTES = 32 * 2**20     # cuBLAS's workspace for captured calls (NVIDIA recommends 32 MiB on Hopper)
_CAPTURE = {}                    # device id -> (ctypes library, handle, workspace)


def _libcublas():
    """The libcublas CuPy has loaded (found in /proc/self/maps after CuPy created its handle), through ctypes."""
    import ctypes

    from cupy.cuda import device
    device.get_cublas_handle()                                     # makes CuPy load the library
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/libcublas.so" in line}
    if not paths:
        raise RuntimeError("blas: libcublas is not loaded in this process (cuBLAS calls cannot be captured)")
    lib = ctypes.CDLL(sorted(paths)[0])
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll,
                                               i, i, i]
    return lib


def prepare_capture():
    """Create (once per GPU, outside any capture) the cuBLAS handle and workspace that captured gemm calls use."""
    import ctypes

    import cupy as cp
    from cupy.cuda import runtime
    if runtime.is_hip:
        return None
    dev = cp.cuda.Device().id
    if dev not in _CAPTURE:
        lib = _libcublas()
        handle = ctypes.c_void_p()
        status = lib.cublasCreate_v2(ctypes.byref(handle))
        if status != 0:
            raise RuntimeError(f"blas: cublasCreate failed with status {status}")
        workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)
        status = lib.cublasSetWorkspace_v2(handle, workspace.data.ptr, WORKSPACE_BYTES)
        if status != 0:
            raise RuntimeError(f"blas: cublasSetWorkspace failed with status {status}")
        _CAPTURE[dev] = (lib, handle, workspace)
    return _CAPTURE[dev]


def _captured_gemm(stream, op_b, op_a, N, M, K, alpha_h, b, dtype, ldb, stride_b, a, lda, stride_a, beta_h, out, G,
                   out_type, compute):
    from cupy.cuda import runtime
    from cupy_backends.cuda.libs import cublas
    if cublas is None or runtime.is_hip:
        raise RuntimeError("blas: captured gemm needs NVIDIA cuBLAS")
    lib, handle, _ = prepare_capture()
    lib.cublasSetStream_v2(handle, stream.ptr)
    status = lib.cublasGemmStridedBatchedEx(
        handle, op_b, op_a, N, M, K, alpha_h.ctypes.data, b.data.ptr, dtype, ldb, stride_b, a.data.ptr, dtype, lda,
        stride_a, beta_h.ctypes.data, out.data.ptr, out_type, N, M * N, G, compute, cublas.CUBLAS_GEMM_DEFAULT)
    if status != 0:
        raise RuntimeError(f"blas: cublasGemmStridedBatchedEx failed with status {status} (during capture)")
    return out
