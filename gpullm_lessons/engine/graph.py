"""StepGraph: one training step of a GPUEngine captured as a CUDA graph (or two, around a data-parallel all-reduce)
and replayed; part of the engine (it runs the engine's own forward, backward and device-side update)."""

from __future__ import annotations

import math


class StepGraph:
    """One training step of a GPUEngine (hip backend, fp32 / bf16) for one batch shape, as a CUDA graph.

    Capture (once per shape): static device buffers for the tokens, the targets, AdamW's scalars (hyper) and the
    result (loss, squared gradient norm); a private CuPy memory pool for everything the step allocates; one eager
    warm-up step (it compiles every kernel and fills the private pool with the blocks the step needs; the model and
    optimizer state are copied to host memory before it and back after it, so it leaves no trace and the copy takes
    no GPU memory); then the same step captured
    on a side stream (cudaStreamBeginCapture, relaxed mode) and instantiated. The step calls the same launchers as
    the eager path; only AdamW differs: adamw_step_device reads lr, lr * wd, the bias corrections and the clip
    threshold from `hyper` and the gradient norm from the grad_sumsq output, because a replay re-runs every launch
    with the arguments it was captured with.
    Replay (every step): copy x, y and hyper into the static buffers, launch the graph, read back (loss, sumsq).
    The private pool is never used by anything else, so the addresses baked into the graph stay valid."""

    def __init__(self, eng, B, T, split=False):
        import cupy as cp

        from ..contracts.adamw import adamw_hyper

        self.eng, self.B, self.T, self.split = eng, B, T, bool(split)
        self.x = cp.zeros((B, T), cp.int32)
        self.y = cp.zeros((B, T), cp.int32)
        self.hyper = cp.asarray(adamw_hyper(0.0, 0.0, 1, *eng.betas))
        self.result = cp.zeros(2, cp.float32)
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream()  # a blocking stream: ordered with work on the default stream
        from ..runtime.blas import prepare_capture

        prepare_capture()  # cuBLAS handle + workspace for captured matrix products
        extra = (eng.half, getattr(eng, "m_scale", None), getattr(eng, "v_scale", None))  # int8 moments: their scales
        state = [eng.params.flat, eng.grads.flat, eng.m, eng.v] + [a for a in extra if a is not None]
        saved = [cp.asnumpy(a) for a in state]  # on the host: a GPU copy would add the model's size to the peak
        parts = [self._grads, self._update] if self.split else [self._whole]
        self.graphs = []
        try:
            with cp.cuda.using_allocator(self.pool.malloc), self.stream:
                for part in parts:  # warm-up: compiles kernels, fills the private pool
                    part()
                self.stream.synchronize()
                for part in parts:  # split: the update's graph reuses backward's freed blocks, safely:
                    self.stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)  # one stream, in order
                    try:
                        part()
                    finally:
                        self.graphs.append(self.stream.end_capture())
        finally:
            eng._cache = None
            cp.cuda.Device().synchronize()
            for dst, src in zip(state, saved):  # neither run leaves a trace in the model or the optimizer
                dst.set(src)
            cp.cuda.Device().synchronize()

    def _grads(self):
        eng = self.eng
        _, loss = eng._forward(self.x, self.y, keep=eng.policy, device_loss=True)
        eng.backward()
        self.result[0:1] = loss

    def _update(self):
        self.eng._update_on_device(self.hyper)
        self.result[1:2] = self.eng._sumsq

    def _whole(self):
        self._grads()
        self._update()

    def step(self, x, y, lr, weight_decay, grad_clip, reduce_grads=None) -> dict:
        if self.split != (reduce_grads is not None):
            raise RuntimeError("StepGraph.step: a split graph needs reduce_grads, a whole one takes none")
        hyper = self.eng._hyper(lr, weight_decay, grad_clip)
        with self.stream:
            self.x.set(x)
            self.y.set(y)
            self.hyper.set(hyper)
            self.graphs[0].launch(self.stream)
            if self.split:
                reduce_grads(self.eng.grads.flat)  # eager, on this stream, between backward's graph and the update's
                self.graphs[1].launch(self.stream)
            loss, sumsq = (float(v) for v in self.result.get(stream=self.stream))
        return {"loss": loss, "grad_norm": math.sqrt(max(sumsq, 0.0)), "skipped": False}

    def pool_bytes(self) -> int:
        """Bytes the step's private pool holds: its working set (activations and temporaries)."""
        return int(self.pool.total_bytes())
