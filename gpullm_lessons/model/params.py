"""GPT configuration and parameters: one flat buffer, with a named view for every tensor.

Why one flat buffer? The optimizer (AdamW) then updates all parameters with one kernel over one array,
gradients are zeroed with one memset, and copying the model to or from the GPU is one transfer. Each
named tensor (``params["qkvw"]``) is a *view* into that buffer: writing through the view writes the buffer.

Layout, in this order (L = n_layer, C = d_model, V = vocab_size, weights stored (in, out)):

    wte (V, C)          token embedding, also the LM head (tied): logits = lnf_out @ wte.T
    wpe (block_size, C) position embedding
    ln1w, ln1b (L, C)   LayerNorm before attention
    qkvw (L, C, 3C), qkvb (L, 3C)           attention input projection
    attprojw (L, C, C), attprojb (L, C)      attention output projection
    ln2w, ln2b (L, C)   LayerNorm before the MLP
    fcw (L, C, 4C), fcb (L, 4C)              MLP up projection
    fcprojw (L, 4C, C), fcprojb (L, C)       MLP down projection
    lnfw, lnfb (C,)     final LayerNorm
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

PARAM_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
               "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")


@dataclasses.dataclass
class GPTConfig:
    """Model size. vocab_size V, block_size = the longest sequence (maxT), n_layer L, n_head nh, d_model C."""
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"GPTConfig: {field.name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"GPTConfig: {field.name} must be positive, got {value}")
            setattr(self, field.name, int(value))
        if self.d_model % self.n_head != 0:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                             f"each head gets d_model // n_head channels")

    @property
    def head_size(self) -> int:
        """hs = C // nh."""
        return self.d_model // self.n_head


# The model presets every entry point shares (the CLI's --preset, the benchmarks, the lessons): a GPTConfig's fields
# plus the batch size and learning rate a run of that size uses.
PRESETS = {
    # the default: trains on the CPU with the NumPy reference in a couple of minutes
    "tiny": dict(n_layer=2, n_head=2, d_model=64, block_size=64, vocab_size=256, batch_size=16, lr=1e-3),
    # the course's GPU model (nanoGPT's shakespeare-char size, 10.8M parameters): for the GPU backends
    "course": dict(n_layer=6, n_head=6, d_model=384, block_size=256, vocab_size=256, batch_size=64, lr=1e-3),
    # GPT-2 small (124M parameters, vocab padded to 50304): for the GPU backends
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, block_size=1024, vocab_size=50304, batch_size=16, lr=6e-4),
}


def preset_config(name: str) -> tuple:
    """(GPTConfig, batch size) of a preset: the model fields of PRESETS[name] as a config, and its batch size."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    p = dict(PRESETS[name])
    B = p.pop("batch_size")
    p.pop("lr")
    return GPTConfig(**p), B


def param_shapes(cfg: GPTConfig) -> dict:
    """name -> shape, in buffer order."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"param_shapes: expected a GPTConfig, got {type(cfg).__name__}")
    V, maxT, L, C = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.d_model
    return {
        "wte": (V, C), "wpe": (maxT, C),
        "ln1w": (L, C), "ln1b": (L, C),
        "qkvw": (L, C, 3 * C), "qkvb": (L, 3 * C),
        "attprojw": (L, C, C), "attprojb": (L, C),
        "ln2w": (L, C), "ln2b": (L, C),
        "fcw": (L, C, 4 * C), "fcb": (L, 4 * C),
        "fcprojw": (L, 4 * C, C), "fcprojb": (L, C),
        "lnfw": (C,), "lnfb": (C,),
    }


def num_params(cfg: GPTConfig) -> int:
    """Total number of parameters = V*C + maxT*C + L*(12*C*C + 13*C) + 2*C."""
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


BLOCK_PARAMS = PARAM_NAMES[2:14]                          # a block's tensors, in the order its forward uses them


def layer_segments(cfg: GPTConfig) -> list:
    """The flat buffer layer by layer, in the order the forward pass uses the layers: [the embeddings (wte, wpe),
    block 0, ..., block L-1, the final LayerNorm (lnfw, lnfb)], each a list of (name, lo, hi): the elements
    flat[lo:hi] of tensor `name` that belong to that layer (block l: the l-th slice of each (L, ...) tensor).

    Together they cover the buffer once. Backward finishes the layers in the reverse order; wte's gradient is final
    last of all (it is also the LM head: its two uses are added at the end)."""
    offsets, start = {}, 0
    for name, shape in param_shapes(cfg).items():
        offsets[name] = start
        start += math.prod(shape)
    C, L = cfg.d_model, cfg.n_layer

    def piece(name, l):                                   # block l's slice of an (L, ...) tensor
        per = math.prod(param_shapes(cfg)[name][1:])
        return name, offsets[name] + l * per, offsets[name] + (l + 1) * per

    emb = [("wte", 0, cfg.vocab_size * C), ("wpe", offsets["wpe"], offsets["wpe"] + cfg.block_size * C)]
    final = [("lnfw", offsets["lnfw"], offsets["lnfw"] + C), ("lnfb", offsets["lnfb"], offsets["lnfb"] + C)]
    return [emb] + [[piece(name, l) for name in BLOCK_PARAMS] for l in range(L)] + [final]


class ParamBuffer:
    """All parameters (or gradients) of a GPT in one flat array, with a named view per tensor.

    >>> p = ParamBuffer(GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, d_model=8))
    >>> p["qkvw"].shape          # a view: p["qkvw"][0, 0, 0] = 1.0 changes p.flat too
    (2, 8, 24)

    ``xp`` is the array module: numpy (default) or cupy for a buffer in GPU memory.
    Dict-like: ``p[name]``, ``p[name] = array`` (copies into the view), ``p.names``, ``p.keys()``, ``p.items()``.
    """

    def __init__(self, cfg: GPTConfig, dtype=np.float32, xp=np):
        dtype = np.dtype(dtype)
        if not np.issubdtype(dtype, np.floating):
            raise TypeError(f"ParamBuffer: dtype must be floating-point, got {dtype}")
        self.cfg = cfg
        self.dtype = dtype
        self.xp = xp
        self.shapes = param_shapes(cfg)                  # name -> shape, in order
        self.flat = xp.zeros(num_params(cfg), dtype=dtype)  # (num_params,) the one buffer
        self.offsets = {}                                # name -> (start, stop) in flat
        self.views = {}                                  # name -> view of flat[start:stop] with its shape
        start = 0
        for name, shape in self.shapes.items():
            stop = start + math.prod(shape)
            self.offsets[name] = (start, stop)
            self.views[name] = self.flat[start:stop].reshape(shape)  # a contiguous slice reshapes as a view
            start = stop

    def pad_to(self, total: int):
        """Move the buffer into zero-padded storage of `total` elements (ZeRO's N equal shards): flat and every named
        view become views of storage[:n], the values copied. Returns the storage; everything that reads self.flat or
        the views keeps working."""
        n = self.flat.size
        if total < n:
            raise ValueError(f"pad_to: total {total} is smaller than the buffer's {n} elements")
        storage = self.xp.zeros(total, self.flat.dtype)
        storage[:n] = self.flat
        self.flat = storage[:n]
        self.views = {k: self.flat[a:b].reshape(self.shapes[k]) for k, (a, b) in self.offsets.items()}
        return storage

    @property
    def names(self) -> list:
        return list(self.views)

    def __getitem__(self, name):
        return self.views[name]

    def __setitem__(self, name, value):
        self.views[name][...] = value                    # copy into the buffer, never rebind the view

    def __contains__(self, name):
        return name in self.views

    def __iter__(self):
        return iter(self.views)

    def __len__(self):
        return len(self.views)

    def keys(self):
        return self.views.keys()

    def items(self):
        return self.views.items()

    def zeros_like(self) -> "ParamBuffer":
        """A new buffer with the same layout, dtype and array module, filled with zeros (e.g. for gradients)."""
        return ParamBuffer(self.cfg, self.dtype, self.xp)

    def copy(self) -> "ParamBuffer":
        """A new buffer with the same layout holding a copy of the values."""
        new = self.zeros_like()
        new.flat[...] = self.flat
        return new

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)

    def __repr__(self):
        where = getattr(self.xp, "__name__", str(self.xp))
        return (f"ParamBuffer({len(self.views)} tensors, {self.flat.size:,} {self.dtype} parameters, "
                f"{self.nbytes / 2**20:.2f} MiB, {where})")


def init_params(cfg: GPTConfig, seed: int = 0, dtype=np.float32, xp=np) -> ParamBuffer:
    """GPT-2 style initialization, deterministic by seed (same values, up to rounding, in any dtype).

    wte, qkvw, fcw ~ N(0, 0.02); attprojw, fcprojw ~ N(0, 0.02 / sqrt(2 L)) (the residual projections,
    scaled down so that the residual stream's variance does not grow with depth); wpe ~ N(0, 0.01);
    LayerNorm weights (ln1w, ln2w, lnfw) = 1; all biases = 0.
    Values are drawn in float64 with numpy's default_rng(seed), tensor by tensor in buffer order, then cast.
    """
    rng = np.random.default_rng(seed)
    host = np.zeros(num_params(cfg), dtype=np.float64)
    L = cfg.n_layer
    std = {"wte": 0.02, "wpe": 0.01, "qkvw": 0.02, "fcw": 0.02,
           "attprojw": 0.02 / math.sqrt(2 * L), "fcprojw": 0.02 / math.sqrt(2 * L)}
    start = 0
    for name, shape in param_shapes(cfg).items():
        stop = start + math.prod(shape)
        if name in std:
            host[start:stop] = rng.normal(0.0, std[name], size=stop - start)
        elif name in ("ln1w", "ln2w", "lnfw"):
            host[start:stop] = 1.0
        # biases stay 0
        start = stop
    params = ParamBuffer(cfg, dtype, xp)
    params.flat[...] = xp.asarray(host.astype(dtype))
    return params
