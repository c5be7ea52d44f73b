"""HostOptimizer: AdamW's state in host memory and its update on the CPU (GPUEngine(offload_optimizer=True), lesson 12).

What stays on the GPU: the fp32 weights the kernels read (LayerNorm's and the biases are read in fp32 in every
precision), their half copy, the gradients. What moves to the host: the fp32 master weights the update writes, and
AdamW's m and v (8 bytes per parameter that the GPU no longer holds), in pinned (page-locked) memory, the only
host memory a copy engine reads and writes while the GPU computes.

A step:
1. backward: as each layer's gradients become final (backward's grads_ready(k)), an event is recorded on the compute
   stream and the copy stream, after waiting for it, copies that layer's ranges to the pinned gradient buffer; the
   copies run while backward goes on with the layers below.
2. the norm for clipping is computed on the GPU as always (grad_sumsq); the host waits for the copy stream.
3. AdamW over the flat buffer in chunks on the CPU (adamw_host: the kernels' formula in float32, element by
   element, so the same bits as the GPU kernel where the GPU does not fuse a multiply-add); each finished chunk's
   weights go back to the GPU on the copy stream while the CPU updates the next chunk.
4. the GPU waits for the copies, zeroes the gradients (as the fused AdamW kernels do) and rewrites the half copy.

The cost is the CPU's update (it reads and writes 28 bytes per parameter at the host's memory bandwidth) plus the
copies the overlap does not hide; lesson 12 measures it. Without a GPU (the CUDA simulator) the "device" arrays are
NumPy arrays and every copy is a plain assignment: the same update, the same bits."""

from __future__ import annotations

import math

import numba
import numpy as np

from ..model.params import layer_segments, num_params

CHUNK = 1 << 22  # elements per CPU update chunk (16 MiB of float32): one host-to-device copy each


@numba.njit(parallel=True, cache=False)
def adamw_host(params, grads, m, v, bounds, flags, lr, lr_wd, beta1, omb1, beta2, omb2, bias1, bias2, eps, gscale):
    """AdamW over params[i] for every i, in float32 as kernels/numba/adamw.py's v2 loop writes it (the tensor of
    element i from bounds/flags: its decay flag). Elements in parallel blocks of 65536, each walking the table."""
    n = params.shape[0]
    nblk = (n + 65535) // 65536
    zero = np.float32(0.0)
    for b in numba.prange(nblk):
        lo = b * 65536
        hi = min(n, lo + 65536)
        j = np.searchsorted(bounds, lo, side="right") - 1
        for i in range(lo, hi):
            while bounds[j + 1] <= i:
                j += 1
            g = grads[i] * gscale
            p = params[i]
            if flags[j] != 0 and lr_wd != zero:
                p = p - lr_wd * p
            mi = beta1 * m[i] + omb1 * g
            vi = beta2 * v[i] + omb2 * (g * g)
            denom = np.float32(math.sqrt(vi / bias2)) + eps
            p = p - (lr * (mi / bias1)) / denom
            params[i] = p
            m[i] = mi
            v[i] = vi


class HostOptimizer:
    """The fp32 master weights, m and v of a GPUEngine in pinned host memory, and the step that updates them there
    (see the module docstring). eng: the GPUEngine (its params, grads, decay table and half copy stay on the GPU)."""

    def __init__(self, eng, chunk=CHUNK):
        self.eng = eng
        self.n = n = num_params(eng.cfg)
        self.chunk = int(chunk)
        self.on_gpu = eng.on_gpu
        if self.on_gpu:
            import cupy as cp
            import cupyx

            empty = lambda: cupyx.empty_pinned(n, np.float32)  # noqa: E731
            self.copy_stream = cp.cuda.Stream(non_blocking=True)
        else:
            empty = lambda: np.empty(n, np.float32)  # noqa: E731
            self.copy_stream = None
        self.master, self.grads, self.m, self.v = empty(), empty(), empty(), empty()
        self.m[...] = 0
        self.v[...] = 0
        from ..kernels.numba.adamw import decay_table

        bounds, flags = decay_table(eng.params, arrays="numpy")
        self.bounds, self.flags = np.asarray(bounds, np.int64), np.asarray(flags, np.uint8)
        self.segments = layer_segments(eng.cfg)
        self.pull_master()
        self._copied = set()  # layer segments whose gradients are on their way to (or in) self.grads this step

    def bytes(self) -> int:
        """Host bytes this optimizer holds (master weights, gradients, m, v: 16 per parameter, pinned on a GPU)."""
        return int(self.master.nbytes + self.grads.nbytes + self.m.nbytes + self.v.nbytes)

    def pull_master(self):
        """The master copy from the GPU's fp32 weights (after init, a load, a broadcast)."""
        self.master[...] = self._get(self.eng.params.flat)

    def _get(self, a):
        return a.get() if self.on_gpu else a

    # ---- gradients to the host -------------------------------------------------------------------------------------
    def backward_started(self):
        """A new backward: no layer's gradients are on their way to the host yet."""
        self._copied.clear()

    def grads_ready(self, k):
        """backward's cue that layer segment k's gradients are final: copy its ranges on the copy stream (queued
        after the compute stream's work so far)."""
        self._copy_ranges([(lo, hi) for _, lo, hi in self.segments[k]])
        self._copied.add(k)

    def _copy_ranges(self, ranges):
        g = self.eng.grads.flat
        if not self.on_gpu:
            for lo, hi in ranges:
                self.grads[lo:hi] = g[lo:hi]
            return
        import cupy as cp

        ev = cp.cuda.Event(disable_timing=True)
        ev.record(cp.cuda.get_current_stream())
        self.copy_stream.wait_event(ev)
        for lo, hi in ranges:
            g[lo:hi].get(stream=self.copy_stream, out=self.grads[lo:hi])

    # ---- the update ------------------------------------------------------------------------------------------------
    def step(self, lr, weight_decay, grad_scale, t, betas, eps):
        """AdamW (step count t) over the whole buffer on the CPU, the weights back on the GPU, the gradients zeroed,
        the half copy rewritten. Gradients not copied during backward (data parallel: after the all-reduce; a
        micro-batch run) are copied now, whole."""
        from ..contracts.adamw import host_scalars

        eng = self.eng
        if len(self._copied) != len(self.segments):
            self._copied.clear()
            self._copy_ranges([(0, self.n)])
        self._copied.clear()
        if self.on_gpu:
            self.copy_stream.synchronize()
        s = host_scalars(lr, betas[0], betas[1], eps, weight_decay, t, grad_scale)
        args = tuple(
            np.float32(s[k])
            for k in ("lr", "lr_wd", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "bias1", "bias2", "eps")
        )
        gscale = np.float32(s["grad_scale"])
        p_dev = eng.params.flat
        for lo in range(0, self.n, self.chunk):
            hi = min(self.n, lo + self.chunk)
            b = self.bounds - lo  # the table in chunk-local indices (clipped: only its order matters)
            adamw_host(self.master[lo:hi], self.grads[lo:hi], self.m[lo:hi], self.v[lo:hi],
                       np.clip(b, 0, hi - lo), self.flags, *args, gscale)  # fmt: skip
            if self.on_gpu:
                p_dev[lo:hi].set(self.master[lo:hi], stream=self.copy_stream)
            else:
                p_dev[lo:hi] = self.master[lo:hi]
        if self.on_gpu:
            import cupy as cp

            ev = cp.cuda.Event(disable_timing=True)
            ev.record(self.copy_stream)
            cp.cuda.get_current_stream().wait_event(ev)  # the GPU's next work sees the new weights
        eng.grads.flat.fill(0)
        if eng.half is not None:
            eng._to_half(eng.params.flat, eng.half)
