"""Gradient buckets in backward order, and the all-reduce overlapped with the backward pass (lesson 12, task 12.3).

Backward finishes the gradients layer by layer from the last layer to the first: the final LayerNorm's first, then
block L-1, ..., block 0, and the embeddings last. Data parallel can start sending a layer's gradients while backward
computes the layers below it, but one collective per tensor is too many small messages (each pays a latency), and one
for the whole buffer can only start at the end. So the tensors are packed into **buckets** of about `limit` elements,
filled in the order backward finishes them; a bucket's all-reduce starts as soon as its last tensor is final.

    buckets = assign_buckets(sizes, limit)          # the tensors of each bucket, the buckets in backward order
    gb = GradBuckets(cfg, comm, limit)              # data parallel's buckets over the engine's flat gradient buffer
    gb.begin(); eng.forward_backward(x, y, grads_ready=gb.ready); gb.finish(grads)   # overlapped
    gb.all_reduce_in_order(grads)                   # the same buckets after backward, one after the other

The flat buffer's layout (model/params.py) is tensor by tensor (all layers' ln1w, then all layers' ln1b, ...), so one
layer's gradients are not contiguous in it. GradBuckets keeps a buffer of its own with the tensors in bucket order:
a layer's slices are copied there when backward reports them final, each bucket is one contiguous piece of it, and
after the all-reduces the (summed, x 1/N) values are copied back. Both paths run the same (non-blocking) collective
on the same pieces, so the overlapped gradients equal the sequential ones bit for bit.
"""

from __future__ import annotations

import time

import numpy as np

from ..model.params import layer_segments


def assign_buckets(sizes, limit) -> list:
    """Pack gradient tensors into buckets in the order backward finishes them.

    sizes[i]: the number of elements of tensor i, the tensors listed in the order the forward pass uses them (tensor
    len(sizes) - 1 is the first whose gradient backward finishes, tensor 0 the last). limit: the most elements a
    bucket holds. Returns a list of buckets, each a list of tensor indices: the first bucket holds the last tensors.
    Walking from the last tensor to the first, a tensor joins the open bucket while the bucket's total stays within
    `limit` (a total of exactly `limit` fits); otherwise the bucket is closed and a new one starts with it. A tensor
    larger than `limit` gets a bucket of its own. No tensor is split or left out."""
    if not limit >= 1:
        raise ValueError(f"assign_buckets: limit must be at least 1 element, got {limit}")
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"assign_buckets: sizes must be >= 0, got {sizes}")
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        if current and total + sizes[i] > limit:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    if current:
        buckets.append(current)
    return buckets


class GradBuckets:
    """The gradient buckets of data parallel over a GPT's flat gradient buffer (module docstring).

    cfg: the model; comm: the communicator; limit: elements per bucket (assign_buckets); xp: numpy or cupy.
    tensors: (layer k of params.layer_segments, name, lo, hi) of every tensor slice, in forward order; buckets: their
    indices per bucket (assign_buckets); bounds: each bucket's (start, stop) in the bucket buffer.
    After a step: total_s (the seconds during which an all-reduce was in flight), exposed_s (the seconds the step
    waited for them after backward), started_early (buckets started before the last layer's gradients were final)."""

    def __init__(self, cfg, comm, limit, xp=np):
        self.comm, self.xp = comm, xp
        self.tensors = [(k, name, lo, hi) for k, layer in enumerate(layer_segments(cfg)) for name, lo, hi in layer]
        self.buckets = assign_buckets([hi - lo for _, _, lo, hi in self.tensors], limit)
        self.pos, self.bounds, p = {}, [], 0
        for b in self.buckets:  # each bucket contiguous, its tensors in the order backward finishes them
            start = p
            for i in b:
                self.pos[i] = p
                p += self.tensors[i][3] - self.tensors[i][2]
            self.bounds.append((start, p))
        self.buf = xp.zeros(p, xp.float32)
        self.layers_of = [{self.tensors[i][0] for i in b} for b in self.buckets]  # the layers a bucket waits for
        self.n_layers = len(layer_segments(cfg))
        self.grads, self.pending, self.final = None, [], set()
        self.total_s = self.exposed_s = 0.0
        self.started_early = 0

    def __len__(self):
        return len(self.buckets)

    def _pack(self, g, layer=None):
        for i, (k, _, lo, hi) in enumerate(self.tensors):
            if layer is None or k == layer:
                self.buf[self.pos[i] : self.pos[i] + hi - lo] = g[lo:hi]

    def _unpack(self, g):
        self.buf *= np.float32(1.0 / self.comm.world_size)  # the sum -> the mean over ranks
        for i, (_, _, lo, hi) in enumerate(self.tensors):
            g[lo:hi] = self.buf[self.pos[i] : self.pos[i] + hi - lo]

    def _sync(self):
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    # ---- overlapped: started from the backward pass's grads_ready ------------------------------------------------
    def begin(self, grads_flat):
        """Before the step's backward: grads_flat is the buffer whose layers ready() will be told about."""
        self.grads, self.pending, self.final, self.started_early = grads_flat, [], set(), 0

    def ready(self, layer):
        """Backward's hook: layer `layer`'s gradients are final. Copies them into their buckets, starts (in bucket
        order, the same on every rank) the all-reduce of each bucket whose layers are all final, and lets the
        requests in flight progress."""
        self._pack(self.grads, layer)
        self.final.add(layer)
        while len(self.pending) < len(self.buckets) and self.layers_of[len(self.pending)] <= self.final:
            a, b = self.bounds[len(self.pending)]
            self.pending.append(self.comm.all_reduce_async(self.buf[a:b]))
            self.started_early += len(self.final) < self.n_layers
        for req in self.pending:
            req.test()

    def finish(self, grads_flat):
        """After backward: wait for every bucket (timed: the exposed communication), then the mean gradient into
        grads_flat. Raises if backward did not report every layer (an engine without the hook)."""
        missing = sorted(set(range(self.n_layers)) - self.final)
        if missing or len(self.pending) != len(self.buckets):
            raise RuntimeError(
                f"GradBuckets.finish: backward reported {len(self.final)} of {self.n_layers} layers final (missing "
                f"{missing}), {len(self.pending)} of {len(self.buckets)} buckets started: the engine's backward must "
                f"call grads_ready(k) for every layer"
            )
        self._sync()  # backward's kernels done: from here on the step waits for communication only
        t0 = time.perf_counter()
        for req in self.pending:
            req.wait()
        self._sync()
        self.exposed_s = time.perf_counter() - t0
        self.total_s = _in_flight(
            [(r.started, r.finished) for r in self.pending], [r.seconds() for r in self.pending], self.xp is not np
        )
        self._unpack(grads_flat)
        self.grads, self.pending = None, []

    # ---- sequential: the same buckets after backward ------------------------------------------------------------
    def all_reduce_in_order(self, grads_flat):
        """The buckets' all-reduces one after the other, after backward (all of it exposed), then the mean gradient
        into grads_flat. Each is the overlapped path's non-blocking all-reduce, waited for at once: MPI's blocking
        and non-blocking all-reduces may add the ranks' values in different orders (on 3 CPU ranks they differ in the
        last bit), and the two paths must give the same bits."""
        self._pack(grads_flat)
        self._sync()
        t0 = time.perf_counter()
        for a, b in self.bounds:
            self.comm.all_reduce_async(self.buf[a:b]).wait()
        self._sync()
        self.total_s = self.exposed_s = time.perf_counter() - t0
        self.started_early = 0
        self._unpack(grads_flat)


def _in_flight(intervals, durations, device_clock) -> float:
    """Seconds during which at least one request was in flight: the union of their host-time intervals; on a GPU
    the sum of their durations on the communication stream (one stream runs them one after the other)."""
    if device_clock:
        return float(sum(durations))
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
