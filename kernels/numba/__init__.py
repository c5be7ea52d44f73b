
_external = {}      # CuPy stream pointer -> Numba's wrapper of it


def launch_stream():
    """The stream every launcher below puts its kernels on: CuPy's current stream on a GPU; 0 (Numba's default
    stream, which is CuPy's default one too) when that is the default stream, and always in the simulator.

    On CuPy's stream, Numba's kernels are ordered with CuPy's work, and a CUDA graph captured on that stream records
    them (the kernel benchmark times every version of both backends that way). A CuPy array's
    ``__cuda_array_interface__`` names that same stream, so Numba's own wait on it before each launch orders
    nothing: it would only make every launch wait for the GPU to finish all queued work, and it is not allowed
    while a stream is being captured. It is switched off the first time a launcher runs on a GPU."""
    from gpullm_lessons import device
    if not device.numba_on_gpu():
        return 0
    import cupy as cp
    if not _external:
        try:
            from numba.cuda.core import config
        except ImportError:  # noqa: BLE001 - older numba-cuda layout
            from numba import config
        config.CUDA_ARRAY_INTERFACE_SYNC = False
        _external[0] = 0
    ptr = cp.cuda.get_current_stream().ptr
    if ptr not in _external:
        from numba import cuda
        _external[ptr] = cuda.external_stream(ptr)
    return _external[ptr]


def device_scratch(shape, dtype):
    """Scratch memory for a launcher's intermediate results: a CuPy array on a GPU (from CuPy's pool, so it is
    ordered on CuPy's stream and can be allocated while a CUDA graph is captured), a Numba device array where CuPy
    is missing or in the simulator. Every element must be written by a kernel before one is read."""
    from gpullm_lessons import device
    if device.numba_on_gpu():
        try:
            import cupy as cp
        except ImportError:  # noqa: BLE001 - Numba without CuPy: its own allocator
            cp = None
        if cp is not None:
            return cp.empty(shape, dtype)
    from numba import cuda
    return cuda.device_array(shape, dtype)
