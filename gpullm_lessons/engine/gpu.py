"""GPUEngine: the course's kernels (backend "hip" or "numba") composed into the GPT; see the package docstring."""

from __future__ import annotations

import math

import numpy as np

from ..model.checkpointing import parse_policy, segments
from ..model.params import ParamBuffer, init_params, num_params
from .profiler import nvtx_range
from ..reference.head import check_chunks
from ..contracts.adamw import int8_blocks
from .core import Engine, EngineError
from .graph import StepGraph
from .profiler import OpProfiler, TimedLaunchers

# the numba backend's kernel versions on a GPU; GPUEngine.DEFAULT_VERSIONS derives hip's and the simulator's from it
_NUMBA_VERSIONS = {
    "layernorm_forward": "v2",
    "layernorm_backward": "v2",
    "gelu": "v1",
    "crossentropy": "v2",
    "encoder": "v2",
    "adamw": "v2",
    "convert": "v1",
    "scores": "half",
    "gelu_in": "f32",
    "attention": "cublas",
    "flash": "v6",
    "tf32": "off",
    "epilogue": "none",
    "dgelu": "cublaslt",
    "logits": "f32",
    "dgelu_out": "f32",
    "dqkv_out": "f32",
    "dres_out": "f32",
}


def flash_unsupported(cfg, backend, precision):
    """Why the flash attention kernels cannot run this model (None when they can): the HIP backend, half precision,
    a head size flash.cu is compiled for."""
    from ..backends.hip.flash import HEAD_SIZES, supports

    hs = cfg.d_model // cfg.n_head
    if backend != "hip":
        return f"the flash kernels on the matrix units are HIP kernels (backend {backend!r})"
    if precision == "fp32":
        return "they read q, k, v in half precision (precision 'fp32')"
    if not supports(hs, precision):
        return f"head size {hs} has no kernel (compiled for {HEAD_SIZES})"
    return None


class GPUEngine(Engine):
    """The course's kernels (backend "hip" or "numba") composed into the GPT; see the module docstring."""

    # the kernel version each op runs with (the fastest simulator-safe one for numba, the fastest for hip);
    # "scores": the format of the attention scores and their gradient between cuBLAS and the softmax kernels in a
    # half-precision run: "half" (cuBLAS rounds them to the run's half format: half the bytes of the largest
    # activation; GPT-2 bf16 on the H200: 64.2 -> 60.6 ms per step) or "f32" (fp32 products, as before 2026-11-30)
    # "gelu_in": the format the MLP keeps GELU's input in for the backward, in a half-precision run: "f32" (fc as the
    # product wrote it, 4 bytes an element, the bias added again in the backward's fused pass) or "half" (the half
    # bits of fc + bias, 2 bytes an element, as torch.compile keeps it; the GELU and its recompute read that rounded
    # value; GPT-2 124M B16 T1024 keeps 1.1 GiB less)
    # "attention": "flash" (kernels/hip/flash.cu, lesson 11: the (T, T) scores never in memory, activations linear in
    # T; the hip default in half precision at the head sizes flash.cu is compiled for) or "cublas" (four batched
    # products around the causal-softmax kernels, lesson 05's path; the numba backend's, fp32's and the fallback
    # where flash cannot run); "flash": the version of flash.cu's kernels on the engine's packed layout (v4, v5 or v6)
    # that the flash path runs; "tf32": "on" reads an fp32 run's matmul inputs as TF32 (10 mantissa bits, fp32
    # accumulation: cuBLAS's TF32 mode on NVIDIA's tensor cores; the simulator rounds the inputs), "off" keeps fp32
    # "epilogue": "cublaslt" (half precision; NVIDIA, or NumPy in the simulator: runtime/blaslt.py) adds the qkv bias
    # inside the qkv product, which writes the half q, k, v the flash kernels read, and each projection's bias and the
    # residual inside its product (out = x + P + b, float32), and with gelu_in "half" the fc product adds its bias and
    # writes GELU's half input itself (GELU's output made from those bits, as the recompute makes it) and the fc
    # projection's backward makes the half dfc in its product (DGELU_BGRAD, with the fc bias gradient); "none" runs
    # the products and the passes after them
    # "dgelu": where that fc projection's backward makes the half dfc under epilogue "cublaslt" and gelu_in "half":
    # "cublaslt" (in the product, DGELU_BGRAD) or "kernel" (a plain product to float32, then colsum_convert's one
    # pass: GELU's derivative, the half dfc and the fc bias gradient, as without the epilogues). On an H100 the
    # DGELU_BGRAD product ran at a quarter of the rate of the step's other products of its size
    # (results/gputime_gpt2_lean_epilogue_h100.json); with "kernel" the fc backward took 3.72 ms per GPT-2 step against
    # DGELU_BGRAD's 5.71 on the same card (results/gputime_gpt2_lean_halflogits_h100.json, one H100 day: the default
    # stays "cublaslt" until the H200 is measured too)
    # "logits": the format the tied head's product writes the logits in, with targets in a bf16 run: "f32" (cuBLAS
    # writes float32 logits, the loss kernel writes bf16 dlogits beside them) or "half" (cuBLAS rounds the logits to
    # bf16 on the way out, as PyTorch's autocast keeps them; the loss kernel reads them and writes the bf16 dlogits
    # over them: half the bytes written by the product and read by the loss, and one (rows, V) buffer instead of
    # two; GPT-2's head 3.59 against 5.01 ms per step on an H100, results/gputime_gpt2_lean_halflogits_h100.json). The
    # loss is then the loss of the rounded logits. Evaluation and next_logits keep float32 logits
    # "dgelu_out": where the fc projection's backward is a plain product followed by colsum_convert's pass (epilogue
    # "none", or dgelu "kernel") with gelu_in "half": the format that product writes GELU's output gradient in,
    # "f32" or "half" (cuBLAS rounds it to the run's half format, as PyTorch's autocast keeps it: the product writes
    # and the pass reads 2 bytes an element instead of 4; dfc = dgelu * gelu'(x) is then made from the rounded dgelu)
    # "dqkv_out": the format the flash backward writes dqkv in, "f32" or "half" (flash v6's _hg entry points, each
    # gradient rounded once; needs epilogue "cublaslt": the qkv weight-gradient product sums dqkv's rows into the qkv
    # bias gradient in its epilogue, BGRADB, so no pass over dqkv converts it or sums its columns; the half dqkv is
    # what the products read without it too)
    # "dres_out": what the LayerNorm backwards inside the blocks write of the residual stream's gradient: "f32"
    # (float32; a layer's colsum_convert pass then makes its half copy and its bias gradient) or "half" (float32 and,
    # in the same pass, its half copy: hip v5's _res_half entry points; with epilogue "cublaslt" the fc and attention
    # projections' bias gradients come from their weight-gradient products' BGRADB epilogue: no pass over the
    # float32 gradient. The last block's incoming gradient, from the final LayerNorm, keeps the pass)
    DEFAULT_VERSIONS = {
        "hip": {**_NUMBA_VERSIONS, "layernorm_backward": "v5", "encoder": "v3", "adamw": "v3", "attention": "flash"},
        "numba": _NUMBA_VERSIONS,
        # the CUDA simulator runs every CUDA thread in Python: the one-thread-per-row versions run far fewer
        # simulated threads and barriers there than the block-per-row ones
        "numba-sim": {**_NUMBA_VERSIONS, "layernorm_forward": "v1", "layernorm_backward": "v1"},
    }

    def __init__(
        self,
        cfg,
        backend,
        precision,
        policy,
        seed,
        betas,
        eps,
        versions=None,
        graphs="off",
        optimizer_state="fp32",
        ce_chunks=1,
        offload_optimizer=False,
    ):
        from .. import device

        super().__init__(cfg, precision, policy, seed, betas, eps, optimizer_state)
        self.backend = backend
        if backend == "hip":
            from ..backends import hip as K
        else:
            from ..backends import numba as K
        self.K = K
        self.on_gpu = device.has_gpu()
        if self.on_gpu:
            import cupy as xp
        else:
            xp = np  # numba in the CUDA simulator: NumPy arrays
        self.xp = xp
        self.ver = dict(self.DEFAULT_VERSIONS[backend if self.on_gpu else "numba-sim"])
        if versions:
            unknown = set(versions) - set(self.ver)
            if unknown:
                raise EngineError(f"versions: unknown op(s) {sorted(unknown)}; known: {sorted(self.ver)}")
            self.ver.update(versions)
        if self.ver["scores"] not in ("f32", "half"):
            raise EngineError(f"versions: scores must be 'f32' or 'half', got {self.ver['scores']!r}")
        if self.ver["gelu_in"] not in ("f32", "half"):
            raise EngineError(f"versions: gelu_in must be 'f32' or 'half', got {self.ver['gelu_in']!r}")
        if self.ver["attention"] not in ("flash", "cublas"):
            raise EngineError(f"versions: attention must be 'flash' or 'cublas', got {self.ver['attention']!r}")
        if self.ver["attention"] == "flash":
            why_not = flash_unsupported(cfg, backend, precision)
            if why_not and versions and "attention" in versions:
                raise EngineError(f"versions: attention='flash' cannot run here: {why_not}")
            if why_not:  # the default where flash cannot run (fp32, a head size without a kernel): the cuBLAS path
                self.ver["attention"] = "cublas"
        if self.ver["epilogue"] not in ("none", "cublaslt"):
            raise EngineError(f"versions: epilogue must be 'none' or 'cublaslt', got {self.ver['epilogue']!r}")
        if self.ver["epilogue"] == "cublaslt" and precision not in ("bf16", "fp16"):
            raise EngineError(
                f"versions: epilogue='cublaslt' fuses the bias into half-precision products; precision={precision!r} "
                "has none (use bf16 or fp16)"
            )
        if self.ver["dgelu"] not in ("cublaslt", "kernel"):
            raise EngineError(f"versions: dgelu must be 'cublaslt' or 'kernel', got {self.ver['dgelu']!r}")
        if versions and "dgelu" in versions and (self.ver["epilogue"], self.ver["gelu_in"]) != ("cublaslt", "half"):
            raise EngineError(
                "versions: dgelu chooses where the fc projection's backward makes dfc under epilogue='cublaslt' and "
                f"gelu_in='half'; this run has epilogue={self.ver['epilogue']!r}, gelu_in={self.ver['gelu_in']!r}"
            )
        if self.ver["logits"] not in ("f32", "half"):
            raise EngineError(f"versions: logits must be 'f32' or 'half', got {self.ver['logits']!r}")
        if self.ver["logits"] == "half" and precision != "bf16":
            raise EngineError(
                f"versions: logits='half' has the head's product write bf16 logits; precision={precision!r} "
                "(fp16's loss scaling multiplies float32 dlogits before rounding them: use bf16)"
            )
        if self.ver["dgelu_out"] not in ("f32", "half"):
            raise EngineError(f"versions: dgelu_out must be 'f32' or 'half', got {self.ver['dgelu_out']!r}")
        if self.ver["dgelu_out"] == "half" and (
            precision == "fp32"
            or self.ver["gelu_in"] != "half"
            or (self.ver["epilogue"] == "cublaslt" and self.ver["dgelu"] == "cublaslt")
        ):
            raise EngineError(
                "versions: dgelu_out='half' has the fc projection's backward product write GELU's output gradient in "
                "half for colsum_convert's pass; it needs a half precision run, gelu_in='half' and that pass (epilogue="
                f"'none', or dgelu='kernel'); this run has precision={precision!r}, gelu_in={self.ver['gelu_in']!r}, "
                f"epilogue={self.ver['epilogue']!r}, dgelu={self.ver['dgelu']!r}"
            )
        if self.ver["dqkv_out"] not in ("f32", "half"):
            raise EngineError(f"versions: dqkv_out must be 'f32' or 'half', got {self.ver['dqkv_out']!r}")
        if self.ver["dqkv_out"] == "half":
            from ..backends.hip.flash import HALF_GRADS

            if (self.ver["attention"], self.ver["epilogue"]) != ("flash", "cublaslt") or self.ver[
                "flash"
            ] not in HALF_GRADS:
                raise EngineError(
                    "versions: dqkv_out='half' has the flash backward write dqkv in half and the qkv weight-gradient "
                    f"product sum it into the bias gradient (cuBLASLt's BGRADB); it needs attention='flash', flash in "
                    f"{', '.join(HALF_GRADS)} and epilogue='cublaslt'; this run has attention={self.ver['attention']!r}, "
                    f"flash={self.ver['flash']!r}, epilogue={self.ver['epilogue']!r}"
                )
        if self.ver["dres_out"] not in ("f32", "half"):
            raise EngineError(f"versions: dres_out must be 'f32' or 'half', got {self.ver['dres_out']!r}")
        if self.ver["dres_out"] == "half" and self.ver["epilogue"] != "cublaslt":
            raise EngineError(
                "versions: dres_out='half' takes the projections' bias gradients from their weight-gradient products "
                f"(cuBLASLt's BGRADB); it needs epilogue='cublaslt' (half precision); this run has "
                f"epilogue={self.ver['epilogue']!r}, precision={precision!r}"
            )
        if self.ver["epilogue"] == "cublaslt" and self.on_gpu and device.kind() != "cuda":
            raise EngineError("versions: epilogue='cublaslt' calls NVIDIA's cuBLASLt; on AMD keep epilogue='none'")
        if self.ver["tf32"] not in ("off", "on"):
            raise EngineError(f"versions: tf32 must be 'off' or 'on', got {self.ver['tf32']!r}")
        if self.ver["tf32"] == "on" and precision != "fp32":
            raise EngineError(
                f"versions: tf32='on' reads fp32 matmul inputs as TF32; precision={precision!r} has "
                f"no fp32 products (use precision='fp32')"
            )
        if self.ver["tf32"] == "on" and self.on_gpu and device.kind() == "rocm":
            raise EngineError("versions: tf32='on' is cuBLAS's TF32 mode (NVIDIA); on AMD keep tf32='off'")
        from ..backends.hip.flash import PACKED, SM90

        if self.ver["flash"] not in PACKED + SM90:
            raise EngineError(f"versions: flash must be one of {', '.join(PACKED + SM90)}, got {self.ver['flash']!r}")
        if self.ver["flash"] in SM90:
            self._check_v7(cfg, precision)
        if backend == "hip" and self.ver["adamw"] == "v3" and num_params(cfg) % 4:
            self.ver["adamw"] = "v2"  # v3 reads float4: the buffer length must be a multiple of 4
        if optimizer_state in ("bf16", "int8") and not (versions and "adamw" in versions):
            self.ver["adamw"] = "v2"  # bf16 / int8 moments: the fused one-pass kernel (adamw_{bf16,int8}_moments_v2)
        host = init_params(cfg, seed=seed, dtype=np.float32)
        self.params = ParamBuffer(cfg, np.float32, xp)
        self.params.flat[...] = xp.asarray(host.flat)
        self.grads = ParamBuffer(cfg, np.float32, xp)
        n = num_params(cfg)
        mdt = xp.uint16 if optimizer_state == "bf16" else xp.float32  # bf16: the moments' bfloat16 bits
        # int8: m int8 and v uint8 (sqrt(v)) codes, with one float32 scale per block of 256 values each (quant's format)
        mdt, vdt = (xp.int8, xp.uint8) if optimizer_state == "int8" else (mdt, mdt)
        self.m_scale = self.v_scale = None
        if optimizer_state == "int8":
            self.m_scale, self.v_scale = (xp.zeros(int8_blocks(n), xp.float32) for _ in range(2))
        self.offload = None  # offload_optimizer: HostOptimizer (engine/offload.py), built once the weights exist
        if offload_optimizer:
            if optimizer_state != "fp32":
                raise EngineError(
                    f"offload_optimizer keeps AdamW's moments in fp32 in host memory (host memory is not what "
                    f"runs out); optimizer_state={optimizer_state!r} shrinks them on the GPU instead: choose one"
                )
            self.m = self.v = None
        else:
            self.m, self.v = xp.zeros(n, mdt), xp.zeros(n, vdt)
        from ..kernels.numba.adamw import decay_table

        self.decay = decay_table(self.params, arrays="cupy" if self.on_gpu else "numpy")
        self.fmt = "tf32" if self.ver["tf32"] == "on" else precision  # gemm input format (runtime/blas.py)
        self.half = None
        if precision != "fp32":
            self.half = xp.zeros(n, xp.uint16)  # the half copy of the weights (bits)
            self.half_views = {
                k: self.half[a:b].reshape(self.params.shapes[k]) for k, (a, b) in self.params.offsets.items()
            }
            self.params_changed()
        if offload_optimizer:
            from .offload import HostOptimizer

            self.offload = HostOptimizer(self)
            self.m, self.v = self.offload.m, self.offload.v  # host arrays: state_dict and the moments' bytes read them
        if precision == "fp16":
            from ..model.precision import DynamicLossScaler

            self.scaler = DynamicLossScaler()
        self._count = xp.zeros(1, xp.int32)
        self._sumsq = xp.zeros(1, xp.float32)  # the squared gradient norm (grad_sumsq)
        self._cache = None
        self.profiler = None
        # train_step replays a CUDA graph ("auto" | "on" | "off", build() passes "off" where graphs cannot apply):
        # it needs AdamW's float4 kernel (n % 4 == 0) and an embedding backward without host work (v2 sorts the
        # tokens on the host: a graph would replay the capture batch's order; v3, the hip default, does not)
        why_not = (
            "the parameter count is not a multiple of 4 (AdamW's float4 kernel)"
            if n % 4
            else "embedding backward v2 sorts tokens on the host"
            if self.ver["encoder"] == "v2"
            else "the optimizer runs on the CPU (offload_optimizer)"
            if offload_optimizer
            else None
        )
        if graphs == "on" and why_not:
            raise EngineError(f"graphs='on': this engine's step cannot be captured: {why_not}")
        self.graphs = graphs in ("auto", "on") and self.on_gpu and why_not is None
        self._graphs = {}  # (B, T, split) -> StepGraph
        self.ce_chunks = check_chunks("GPUEngine", ce_chunks)  # the loss head in chunks of rows (_head_chunked)
        self._graphs_required = graphs == "on"

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _host(self, a, dtype=np.float32):
        return np.array(self.xp.asnumpy(a) if self.on_gpu else a, dtype=dtype, copy=True)

    def _dev(self, a):
        return self.xp.asarray(a)

    def params_changed(self):
        """Refresh the half copy of the weights from the fp32 master (after init, a load, a broadcast, a gather), and
        with offload_optimizer the host's master copy."""
        if self.half is not None:
            self._to_half(self.params.flat, self.half)
        if getattr(self, "offload", None) is not None:
            self.offload.pull_master()

    def _load_moments(self, moments: dict) -> None:
        if self.m_scale is not None:
            self._load_int8_scales(moments)
        if self.offload is None:
            return super()._load_moments(moments)
        self.m[...] = moments["m"]  # host memory: no copy to the GPU
        self.v[...] = moments["v"]

    def optimizer_shard(self, lo, hi, params, grads):
        if self.offload is not None:
            raise EngineError(
                "optimizer_shard: ZeRO shards the optimizer state across GPUs; this engine keeps it in host memory "
                "(offload_optimizer): use one or the other"
            )
        return super().optimizer_shard(lo, hi, params, grads)

    def _to_half(self, src, dst=None):
        """src float32 (contiguous) -> its half bits (uint16, same shape) through our conversion kernels."""
        xp = self.xp
        src = xp.ascontiguousarray(src)
        if dst is None:
            dst = xp.empty(src.shape, xp.uint16)
        fn = self.K.f32_to_bf16 if self.precision == "bf16" else self.K.f32_to_f16
        fn(src.reshape(-1), dst.reshape(-1), version=self.ver["convert"])
        return dst

    def _w(self, name, l=None):
        """A weight in the gemm format (fp32 master view, or the half copy's view)."""
        src = self.params.views if self.half is None else self.half_views
        return src[name] if l is None else src[name][l]

    def enable_profiling(self) -> OpProfiler:
        """Time every launcher and matrix product from now on (see OpProfiler); returns the profiler."""
        self.profiler = OpProfiler(self.on_gpu)
        self.K = TimedLaunchers(self.K if not isinstance(self.K, TimedLaunchers) else self.K._module, self.profiler)
        return self.profiler

    def _gemm(self, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        from ..runtime.blas import gemm

        fmt = self.fmt
        if fmt == "fp16":
            a, b = a.view(self.xp.float16), b.view(self.xp.float16)
        if self.profiler is not None:
            return self.profiler.wrap(f"gemm {fmt} (cuBLAS)", gemm)(a, b, out, trans_a, trans_b, alpha, beta, fmt)
        return gemm(a, b, out, trans_a, trans_b, alpha, beta, fmt)

    @property
    def _half(self):
        """The fused kernels' output format: None (float32) or "bf16" / "fp16" (uint16 bits)."""
        return None if self.half is None else self.precision

    def _mm_empty(self, shape):
        """An uninitialised matmul input in the run's format (float32, or uint16 half bits)."""
        return self.xp.empty(shape, self.xp.float32 if self.half is None else self.xp.uint16)

    def _matmul_bias(self, inp_mm, name_w, name_b, l, out, res=None):
        """out = inp @ W + b (+ res), the bias (and the residual) added in the product's epilogue (versions
        epilogue "cublaslt"): out in the matmul format (no res; the bias read from the half copy of the weights,
        cuBLASLt's bias having out's type) or float32 (res, float32; the float32 bias)."""
        a, w = inp_mm.reshape(-1, inp_mm.shape[-1]), self._w(name_w, l)
        bias = self.params[name_b][l] if res is not None else self._w(name_b, l)
        what = "gemm+bias+residual" if res is not None else "gemm+bias"
        c = None if res is None else res.reshape(out.shape)
        return self._epilogue_product(what, a, w, out, "bias", bias=bias, c=c)

    def _check_v7(self, cfg, precision):
        """versions flash 'v7' (kernels/sm90, Hopper's wgmma): the flash path, bf16, head size 64, an H100 / H200."""
        from ..runtime import sm90

        why = None
        if self.ver["attention"] != "flash":
            why = f"it is a flash kernel and attention is {self.ver['attention']!r}"
        elif precision != "bf16":
            why = f"its kernels are written for bf16 (precision={precision!r})"
        elif cfg.d_model // cfg.n_head != sm90.V7_HS:
            why = f"its kernels are written for head size {sm90.V7_HS} (this model: {cfg.d_model // cfg.n_head})"
        elif not self.on_gpu:
            why = "it runs on an NVIDIA H100 / H200 only (the simulator cannot run wgmma): use flash='v6'"
        else:
            try:
                sm90.require_hopper()
            except sm90.NotHopperError as e:
                why = str(e)
        if why:
            raise EngineError(f"versions: flash='v7' cannot run here: {why}")

    def _epilogue_product(self, what, *args, **kw):
        """runtime/blaslt.py's matmul_epilogue(*args, **kw) in the run's format, timed as `what` when profiling."""
        from ..runtime.blaslt import matmul_epilogue

        kw["fmt"] = self.precision
        if self.profiler is not None:
            return self.profiler.wrap(f"{what} {self.precision} (cuBLASLt)", matmul_epilogue)(*args, **kw)
        return matmul_epilogue(*args, **kw)

    def _matmul(self, inp_mm, name_w, l, out_features):
        """(N, C_in) matmul input -> (N, C_out) fp32 = inp @ W (the bias is added by the fused kernel after it)."""
        out = self.xp.empty((inp_mm.shape[0], out_features), self.xp.float32)
        self._gemm(inp_mm, self._w(name_w, l), out)
        return out

    def _linear_backward(self, dout, inp_mm, name_w, name_b, l, in_features, out_mm=False, gelu_in=None):
        """dout (N, C_out) fp32 -> dinp (N, C_in) fp32 (out_mm: in the matmul format, cuBLAS rounding the fp32 sums on
        the way out); writes grads[name_w][l] and grads[name_b][l].

        One fused pass over dout (colsum_convert) gives the bias gradient (its column sums, deterministic) and the
        half copy the two products read. gelu_in = (pre, bias) (half precision only): dout is the gradient of GELU's
        output and pre + bias[col] GELU's input (pre float32), or pre itself (its half bits, bias None: versions
        gelu_in "half"); the pass applies GELU's backward on the way (the layer's output gradient is
        dout * gelu'(GELU's input))."""
        if self.half is None:
            if gelu_in is not None:
                raise EngineError("_linear_backward: gelu_in needs a half precision run (the fused pass writes half)")
            self.K.colsum_convert(dout, self.grads[name_b][l])
            dout_mm = dout
        else:
            dout_mm = self._mm_empty(dout.shape)
            pre, bias = gelu_in if gelu_in is not None else (None, None)
            self.K.colsum_convert(
                dout, self.grads[name_b][l], out=dout_mm, half=self._half, gelu_of=pre, gelu_bias=bias
            )
        return self._linear_products(dout_mm, inp_mm, name_w, l, in_features, out_mm)

    def _linear_products(self, dout_mm, inp_mm, name_w, l, in_features, out_mm=False, bias_grad=None):
        """A layer's two backward products from its output gradient in the matmul format: dinp = dout @ W.T (float32,
        or out_mm: the matmul format) and grads[name_w][l] = inp.T @ dout. bias_grad (a bias's name, half precision
        with epilogue "cublaslt"): the dW product also writes grads[bias_grad][l], the column sums of dout, in its
        epilogue (cuBLASLt's BGRADB, float32 like dW). Returns dinp."""
        shape = (dout_mm.shape[0], in_features)
        dinp = self._mm_empty(shape) if out_mm else self.xp.empty(shape, self.xp.float32)
        self._gemm(dout_mm, self._w(name_w, l), dinp, trans_b=True)  # dinp = dout @ W.T
        if bias_grad is None:
            self._gemm(inp_mm, dout_mm, self.grads[name_w][l], trans_a=True)  # dW = inp.T @ dout
        else:  # dW = inp.T @ dout, db = the column sums of dout
            self._epilogue_product(
                "gemm+bgrad",
                inp_mm,
                dout_mm,
                self.grads[name_w][l],
                "bgrad_b",
                bias=self.grads[bias_grad][l],
                trans_a=True,
            )
        return dinp

    def _layernorm(self, x, name_w, name_b, l):
        """LayerNorm of x (N, C) fp32 -> (out in the matmul format, mean, rstd): fp32 runs write float32, half
        precision runs write the half bits directly (layernorm_forward_half: no fp32 copy, no conversion pass)."""
        xp, N = self.xp, x.shape[0]
        C = self.cfg.d_model
        w = self.params[name_w] if l is None else self.params[name_w][l]
        b = self.params[name_b] if l is None else self.params[name_b][l]
        out, mean, rstd = self._mm_empty((N, C)), xp.empty(N, xp.float32), xp.empty(N, xp.float32)
        if self.half is None:
            self.K.layernorm_forward(x, w, b, out, mean, rstd, version=self.ver["layernorm_forward"])
        else:
            self.K.layernorm_forward_half(x, w, b, out, mean, rstd, half=self._half)
        return out, mean, rstd

    def _layernorm_backward(self, dout, x, mean, rstd, name_w, name_b, l, residual=None, half_copy=False):
        """dout (N, C) -> dx (N, C); writes the layernorm's weight and bias gradients. residual: the gradient that
        reaches x past the sublayer (the residual connection), added into dx in place. half_copy (with residual, half
        precision): returns (dx, dx_mm), dx_mm its half bits written in the same launch."""
        xp = self.xp
        w = self.params[name_w] if l is None else self.params[name_w][l]
        dw = self.grads[name_w] if l is None else self.grads[name_w][l]
        db = self.grads[name_b] if l is None else self.grads[name_b][l]
        dx = xp.empty_like(x)
        if half_copy:
            dx_mm = self._mm_empty(x.shape)
            self.K.layernorm_backward(
                dout,
                x,
                w,
                mean,
                rstd,
                dx,
                dw,
                db,
                version=self.ver["layernorm_backward"],
                residual=residual,
                dinp_half=dx_mm,
                half=self._half,
            )
            return dx, dx_mm
        self.K.layernorm_backward(
            dout, x, w, mean, rstd, dx, dw, db, version=self.ver["layernorm_backward"], residual=residual
        )  # residual: added into dx by the launcher (hip v5: in the kernel's own pass, no pass of its own)
        return dx

    def _gelu_mm(self, fc, l):
        """GELU of the kept fc (N, 4C) -> the matmul input: fp32 runs keep fc with its bias (bias_gelu_forward with a
        zero bias), half runs without it (the bias added on the way, fc not rewritten), or as the half bits of
        fc + bias (versions gelu_in "half": gelu_half, the forward's bits)."""
        out = self._mm_empty(fc.shape)
        if self.half is None:
            self.K.bias_gelu_forward(fc, self._zeros(fc.shape[1]), fc, out)  # fc + 0 = fc: rewritten unchanged
        elif fc.dtype == self.xp.uint16:
            self.K.gelu_half(fc, out, self._half)
        else:
            self.K.bias_gelu_forward(fc, self.params["fcb"][l], None, out, half=self._half)
        return out

    def _zeros(self, n):
        z = getattr(self, "_zero_vec", None)
        if z is None or z.shape[0] < n:
            z = self._zero_vec = self.xp.zeros(n, self.xp.float32)
        return z[:n]

    # ---- one block ----------------------------------------------------------------------------------------------
    def _block_forward(self, x, l, B, T, keep):
        """x (B*T, C) -> x_out, cache dict; keep: which policy decides what the cache holds.

        Between the matrix products only fused kernels run (kernels/hip/fused.cu and its Numba twin): LayerNorm
        writes the matmul input directly; split_heads adds the qkv bias while it moves q, k, v into (B*nh, T, hs)
        in the matmul format; the causal softmax writes the probabilities in the matmul format (half runs keep no
        fp32 copy: the softmax backward reads the half one); merge_heads brings the heads back. Flash attention
        reads q, k, v where they are: split_heads as one head of 3C columns only adds the bias and rounds qkv to the
        matmul format, and the packed kernels write y straight into the attention projection's input (no merge, no
        fp32 y). bias_add adds each projection's bias and the residual in one pass; bias_gelu_forward adds the fc
        bias (fc is kept for the GELU backward: with its bias in fp32 runs, without it in half runs, whose backward
        adds it again in its fused pass, or as the half bits of fc + bias with versions gelu_in "half") and writes
        GELU's output in the matmul format. With versions epilogue "cublaslt" the products add the biases (and the
        residuals) themselves (_matmul_bias): no split, bias_add or bias_gelu_forward pass runs where they do."""
        xp, cfg = self.xp, self.cfg
        C, nh = cfg.d_model, cfg.n_head
        hs = C // nh
        half = self._half
        c = {"x": x}
        ln1_mm, c["mean1"], c["rstd1"] = self._layernorm(x, "ln1w", "ln1b", l)
        fused = self.ver["epilogue"] == "cublaslt"
        flash = self.ver["attention"] == "flash"
        qkv = None if fused and flash else self._matmul(ln1_mm, "qkvw", l, 3 * C)  # (B*T, 3C), no bias yet
        qkvb = self.params["qkvb"][l]
        if flash:  # y and each row's log-sum-exp; the (T, T) scores never exist
            atty_mm = self._mm_empty((B * T, C))
            qkv_mm = self._mm_empty((B, T, 3 * C))  # q, k, v side by side, bias added, in the matmul format
            if fused:  # the product adds the bias and writes the half q, k, v itself
                self._matmul_bias(ln1_mm, "qkvw", "qkvb", l, qkv_mm.reshape(B * T, 3 * C))
            else:
                self.K.split_heads(qkv, 0, qkv_mm, B, T, 1, bias=qkvb, half=half)
            del qkv
            att = {"lse": xp.empty((B, nh, T), xp.float32)}
            self.K.flash_attention_forward_packed(
                qkv_mm, atty_mm.reshape(B, T, C), att["lse"], nh, half=half, version=self.ver["flash"]
            )
            heads = {"qkv_mm": qkv_mm}
        else:
            q, k, v = (self._mm_empty((B * nh, T, hs)) for _ in range(3))
            for i, dst in enumerate((q, k, v)):
                self.K.split_heads(qkv, i * C, dst, B, T, nh, bias=qkvb[i * C : (i + 1) * C], half=half)
            del qkv
            y = xp.empty((B * nh, T, hs), xp.float32)
            att = {"att_mm": self._attention_probabilities(q, k, B, T, hs)}
            self._gemm(att["att_mm"], v, y)  # att @ v
            atty_mm = self._mm_empty((B * T, C))
            self.K.merge_heads(y, atty_mm, 0, B, T, nh, half=half)
            del y
            heads = {"q": q, "k": k, "v": v}
        if fused:  # x1 = x + atty @ W + b, in the product
            x1 = self._matmul_bias(atty_mm, "attprojw", "attprojb", l, xp.empty((B * T, C), xp.float32), res=x)
        else:
            x1 = self._matmul(atty_mm, "attprojw", l, C)
            self.K.bias_add(x1, self.params["attprojb"][l], x1, res=x)  # x1 = x + atty @ W + b
        ln2_mm, c["mean2"], c["rstd2"] = self._layernorm(x1, "ln2w", "ln2b", l)
        if fused and self.ver["gelu_in"] == "half":
            # the product adds the fc bias and writes GELU's input in half itself (the kept fc: no float32 product);
            # GELU's output comes from those half bits, as the selective recompute makes it (_gelu_mm): the same bits
            fc = self._matmul_bias(ln2_mm, "fcw", "fcb", l, self._mm_empty((B * T, 4 * C)))
            gelu_mm = self._gelu_mm(fc, l)
        else:
            fc = self._matmul(ln2_mm, "fcw", l, 4 * C)
            gelu_mm = self._mm_empty(fc.shape)
            if half is None:
                self.K.bias_gelu_forward(fc, self.params["fcb"][l], fc, gelu_mm)  # fc += b; gelu(fc)
            elif self.ver["gelu_in"] == "half":  # keep half(fc + b), GELU's input, instead of the float32 fc
                fc_half = self._mm_empty(fc.shape)
                self.K.bias_gelu_forward(fc, self.params["fcb"][l], fc_half, gelu_mm, half=half)
                del fc
                fc = fc_half
            else:  # gelu(fc + b) in the matmul format; fc is not rewritten
                self.K.bias_gelu_forward(fc, self.params["fcb"][l], None, gelu_mm, half=half)
        if fused:  # x2 = x1 + gelu @ W + b, in the product
            x2 = self._matmul_bias(gelu_mm, "fcprojw", "fcprojb", l, xp.empty((B * T, C), xp.float32), res=x1)
        else:
            x2 = self._matmul(gelu_mm, "fcprojw", l, C)
            self.K.bias_add(x2, self.params["fcprojb"][l], x2, res=x1)  # x2 = x1 + gelu @ W + b
        if keep == "none":
            c.update(
                att,
                **heads,
                ln1_mm=ln1_mm,
                atty_mm=atty_mm,
                x1=x1,
                ln2_mm=ln2_mm,
                fc=fc,
                gelu_mm=gelu_mm,
            )
        elif keep == "selective":  # LayerNorm and GELU outputs are rebuilt in backward
            c.update(att, **heads, atty_mm=atty_mm, x1=x1, fc=fc)
        # "full": only x (the caller keeps it; the rest is recomputed)
        return x2, c

    def _attention_probabilities(self, q, k, B, T, hs):
        """The cuBLAS path: the causal softmax of the scores q k^T / sqrt(hs), (B*nh, T, T) in the matmul format."""
        xp, half = self.xp, self._half
        nh = q.shape[0] // B
        half_scores = half is not None and self.ver["scores"] == "half"
        att = self._mm_empty((B * nh, T, T)) if half_scores else xp.empty((B * nh, T, T), xp.float32)
        self._gemm(q, k, att, trans_b=True)  # raw scores q @ k.T
        scale = 1.0 / math.sqrt(hs)
        if half is None:
            self.K.attention_softmax_forward(att.reshape(-1, T), att.reshape(-1, T), scale)
            return att
        att_mm = self._mm_empty((B * nh, T, T))
        self.K.attention_softmax_forward(att.reshape(-1, T), None, scale, att_half=att_mm.reshape(-1, T), half=half)
        return att_mm

    def _rebuild(self, c, l):
        """Selective recompute: the LayerNorm outputs from x / x1 and the GELU output from fc."""
        c["ln1_mm"] = self._layernorm(c["x"], "ln1w", "ln1b", l)[0]
        c["ln2_mm"] = self._layernorm(c["x1"], "ln2w", "ln2b", l)[0]
        c["gelu_mm"] = self._gelu_mm(c["fc"], l)

    def _dgelu_linear_backward(self, dout, gelu_mm, pre_half, l, hidden, dout_mm=None):
        """The fc projection's backward with the epilogues (versions epilogue "cublaslt", gelu_in "half"): its bias
        gradient and the half dout in one pass (colsum_convert), its weight gradient, then dfc = (dout @ W.T) *
        gelu'(pre) in the product, rounded to half, with the fc bias gradient summed in the same epilogue (in half:
        cuBLASLt writes it in out's type, as PyTorch's autocast does; widened into the float32 gradient here).
        dout_mm (versions dres_out "half"): dout's half copy, already made: the bias gradient from the dW product."""
        from ..runtime.blas import _to_f32

        if dout_mm is None:
            dout_mm = self._mm_empty(dout.shape)
            self.K.colsum_convert(dout, self.grads["fcprojb"][l], out=dout_mm, half=self._half)
            self._gemm(gelu_mm, dout_mm, self.grads["fcprojw"][l], trans_a=True)  # dW = gelu.T @ dout
        else:  # dW = gelu.T @ dout and the bias gradient, its column sums, in the product
            self._epilogue_product(
                "gemm+bgrad",
                gelu_mm,
                dout_mm,
                self.grads["fcprojw"][l],
                "bgrad_b",
                bias=self.grads["fcprojb"][l],
                trans_a=True,
            )
        dfc_mm = self._mm_empty((dout.shape[0], hidden))
        dfcb = self.xp.empty(hidden, self.xp.uint16)  # the fc bias gradient in half, as cuBLASLt writes it
        self._epilogue_product(
            "gemm+dgelu+bgrad",
            dout_mm,
            self._w("fcprojw", l),
            dfc_mm,
            "dgelu_bgrad",
            bias=dfcb,
            aux=pre_half.reshape(dfc_mm.shape),
            trans_b=True,
        )
        self.grads["fcb"][l][...] = _to_f32(dfcb, self.precision, self.xp)
        return dfc_mm

    def _block_backward(self, dx, c, l, B, T, dx_mm=None):
        """d(block output) (B*T, C) -> d(block input); writes layer l's gradients.

        dx_mm (versions dres_out "half"): dx's half copy, made by the LayerNorm backward above (None for the last
        block: the final LayerNorm's backward makes none); then returns (d(block input), its half copy, None for
        block 0, whose gradient only the embedding reads).

        Temporaries are dropped (del) as soon as they are used up, so that the backward's working set stays one
        or two (B, T, 4C) tensors plus, on the cuBLAS attention path, one (B, nh, T, T): engine_memory() counts the
        same live sets."""
        xp, cfg = self.xp, self.cfg
        C, nh = cfg.d_model, cfg.n_head
        hs = C // nh
        half = self._half
        # MLP: x2 = x1 + fcproj(gelu(fc(ln2(x1))))
        dres = self.ver["dres_out"] == "half"
        if self.ver["epilogue"] == "cublaslt" and c["fc"].dtype == xp.uint16 and self.ver["dgelu"] == "cublaslt":
            # GELU's backward and the fc bias gradient inside the product that makes dgelu (DGELU_BGRAD): the half
            # dfc comes out of the product, with no float32 dgelu and no pass over it
            dfc_mm = self._dgelu_linear_backward(dx, c["gelu_mm"], c["fc"], l, 4 * C, dout_mm=dx_mm)
            dln2 = self._linear_products(dfc_mm, c["ln2_mm"], "fcw", l, C)  # its bias gradient came with dfc
            del dfc_mm
        elif half is None:
            dgelu = self._linear_backward(dx, c["gelu_mm"], "fcprojw", "fcprojb", l, 4 * C)
            dfc = xp.empty_like(dgelu)
            self.K.gelu_backward(dgelu.reshape(-1), c["fc"].reshape(-1), dfc.reshape(-1), version=self.ver["gelu"])
            del dgelu
            dln2 = self._linear_backward(dfc, c["ln2_mm"], "fcw", "fcb", l, C)
            del dfc
        else:  # GELU's backward inside the fc layer's pass over dfc (colsum_convert): no float32 dfc
            # fc kept without its bias (float32), or GELU's input itself as half bits (gelu_in "half")
            half_dgelu = self.ver["dgelu_out"] == "half"  # the product rounds dgelu to half (gelu_in "half" only)
            if dx_mm is not None:  # the half copy made by the LayerNorm backward above; the bias gradient in the dW
                dgelu = self._linear_products(dx_mm, c["gelu_mm"], "fcprojw", l, 4 * C, half_dgelu, "fcprojb")
            else:
                dgelu = self._linear_backward(dx, c["gelu_mm"], "fcprojw", "fcprojb", l, 4 * C, out_mm=half_dgelu)
            gelu_in = (c["fc"], None if c["fc"].dtype == xp.uint16 else self.params["fcb"][l])
            dln2 = self._linear_backward(dgelu, c["ln2_mm"], "fcw", "fcb", l, C, gelu_in=gelu_in)
            del dgelu
        dx_mm = None
        out = self._layernorm_backward(dln2, c["x1"], c["mean2"], c["rstd2"], "ln2w", "ln2b", l, dx, half_copy=dres)
        dx1, dx1_mm = out if dres else (out, None)
        del dln2, out
        # attention: x1 = x + attproj(attention(qkv(ln1(x))))
        half_dqkv = "lse" in c and self.ver["dqkv_out"] == "half"
        if "lse" in c:  # flash: dq, dk, dv from the kept y (atty_mm) and lse, the probabilities recomputed tile by tile
            if dx1_mm is not None:  # (B*T, C) in the matmul format; the bias gradient in the dW product
                dy = self._linear_products(dx1_mm, c["atty_mm"], "attprojw", l, C, True, "attprojb")
            else:
                dy = self._linear_backward(dx1, c["atty_mm"], "attprojw", "attprojb", l, C, out_mm=True)
            # every element written: dq, dk, dv side by side (dqkv_out "half": in the matmul format)
            dqkv = self._mm_empty((B * T, 3 * C)) if half_dqkv else xp.empty((B * T, 3 * C), xp.float32)
            y, dqkv3 = c["atty_mm"].reshape(B, T, C), dqkv.reshape(B, T, 3 * C)
            self.K.flash_attention_backward_packed(
                c["qkv_mm"], y, dy.reshape(B, T, C), c["lse"], dqkv3, nh, half=half, version=self.ver["flash"]
            )
            del dy
        else:
            if dx1_mm is not None:
                datty = self._linear_products(dx1_mm, c["atty_mm"], "attprojw", l, C, bias_grad="attprojb")
            else:
                datty = self._linear_backward(dx1, c["atty_mm"], "attprojw", "attprojb", l, C)
            dy = self._mm_empty((B * nh, T, hs))
            self.K.split_heads(datty, 0, dy, B, T, nh, half=half)  # (B*nh, T, hs)
            del datty
            box = [dy]  # the helper drops dy as soon as it is used up (no reference left here)
            del dy
            dqkv = self._attention_backward_cublas(box, c, B, T, hs)
        if half_dqkv:  # the products read the half dqkv as written; the bias gradient from the dW product (BGRADB)
            dln1 = self._linear_products(dqkv, c["ln1_mm"], "qkvw", l, C, bias_grad="qkvb")
        else:
            dln1 = self._linear_backward(dqkv, c["ln1_mm"], "qkvw", "qkvb", l, C)
        del dqkv
        del dx1_mm
        copy = dres and l > 0  # block 0's input gradient goes to the embedding only: no half copy
        out = self._layernorm_backward(dln1, c["x"], c["mean1"], c["rstd1"], "ln1w", "ln1b", l, dx1, half_copy=copy)
        del dln1
        if not dres:
            return out
        return out if copy else (out, None)

    def _attention_backward_cublas(self, box, c, B, T, hs):
        """dqkv (B*T, 3C) fp32 from dy (B*nh, T, hs; box = [dy], emptied here) and the saved probabilities att_mm:
        four batched products around the causal softmax backward (lesson 05)."""
        xp, half = self.xp, self._half
        dy = box.pop()
        nh = c["q"].shape[0] // B
        C = nh * hs
        dv = xp.empty((B * nh, T, hs), xp.float32)
        self._gemm(c["att_mm"], dy, dv, trans_a=True)  # dv = att.T @ dy
        half_scores = half is not None and self.ver["scores"] == "half"
        datt = self._mm_empty((B * nh, T, T)) if half_scores else xp.empty((B * nh, T, T), xp.float32)
        self._gemm(dy, c["v"], datt, trans_b=True)  # datt = dy @ v.T
        del dy
        scale = 1.0 / math.sqrt(hs)
        if half is None:  # dpre, in place, scale folded in
            self.K.attention_softmax_backward(
                c["att_mm"].reshape(-1, T), datt.reshape(-1, T), datt.reshape(-1, T), scale
            )
            dpre_mm = datt
        else:  # half probabilities in, half dpre out
            dpre_mm = self._mm_empty((B * nh, T, T))
            self.K.attention_softmax_backward(
                c["att_mm"].reshape(-1, T), datt.reshape(-1, T), dpre_mm.reshape(-1, T), scale, half=half
            )
        del datt
        dqkv = xp.empty((B * T, 3 * C), xp.float32)
        self.K.merge_heads(dv, dqkv, 2 * C, B, T, nh)
        del dv
        for i, (b, ta) in enumerate(((c["k"], False), (c["q"], True))):
            part = xp.empty((B * nh, T, hs), xp.float32)
            self._gemm(dpre_mm, b, part, trans_a=ta)  # dq = dpre @ k, dk = dpre.T @ q
            self.K.merge_heads(part, dqkv, i * C, B, T, nh)
            del part
        return dqkv

    # ---- the model ----------------------------------------------------------------------------------------------
    def _embed(self, x):
        xp = self.xp
        B, T = x.shape
        idx = xp.asarray(x)
        return (self.params["wte"][idx] + self.params["wpe"][:T]).reshape(B * T, self.cfg.d_model), idx

    def forward(self, x, y=None):
        """Logits (B, T, V) fp32 and, with targets, the mean loss; keeps what backward needs (the policy's cache).
        With ce_chunks > 1 and targets the logits never exist whole (_head_chunked): (None, loss); with versions
        logits "half" and targets the dlogits are written over them: (None, loss) too."""
        x, y = self._check_batch("forward", x, y)
        return self._forward(x, y, keep=self.policy)

    def _forward(self, x, y, keep, device_loss=False, grads=True):
        """grads=False (evaluation): with ce_chunks > 1 the head computes the loss only, not its gradients."""
        xp, cfg = self.xp, self.cfg
        B, T = x.shape
        V = cfg.vocab_size
        h, idx = self._embed(x)
        keep, k = parse_policy(keep, cfg.n_layer)
        starts = {a for a, _ in segments(cfg.n_layer, k)} if keep == "sqrt" else ()
        blocks = []
        for l in range(cfg.n_layer):
            x_in = h
            h, c = self._block_forward(h, l, B, T, keep if keep in ("none", "selective") else "full")
            if keep == "sqrt":  # a segment's input only (backward recomputes the segment from it)
                blocks.append({"x": x_in} if l in starts else None)
            else:
                blocks.append(c if keep != "full" else {"x": x_in})
        lnf_mm, meanf, rstdf = self._layernorm(h, "lnfw", "lnfb", None)
        if y is not None and self.ce_chunks > 1:  # the head's backward with its forward, chunk by chunk
            losses, dlnf = self._head_chunked(lnf_mm, xp.asarray(y).reshape(-1), grads)
            loss = losses.mean() if device_loss else float(losses.mean())
            if grads:
                scale = self.scaler.scale if self.scaler is not None else 1.0
                self._cache = dict(
                    B=B, T=T, idx=idx, blocks=blocks, h=h, meanf=meanf, rstdf=rstdf, dlnf=dlnf, scale=scale
                )
            return None, loss
        half_logits = y is not None and grads and self.ver["logits"] == "half"
        logits = xp.empty((B * T, V), xp.uint16 if half_logits else xp.float32)
        self._gemm(lnf_mm, self._w("wte"), logits, trans_b=True)  # tied head: lnf @ wte.T
        loss = None
        if y is not None:
            targets = xp.asarray(y).reshape(-1)
            losses = xp.empty(B * T, xp.float32)
            if half_logits:  # bf16 logits in, bf16 dlogits written over them (the logits are gone: none returned)
                dlogits = logits
                self.K.crossentropy_forward_backward_half(logits, targets, losses, dlogits, half="bf16")
                logits = None
            elif self.precision == "bf16":  # dlogits written in bf16 by the loss kernel: the head products' input
                dlogits = xp.empty((B * T, V), xp.uint16)
                self.K.crossentropy_forward_backward_half(logits, targets, losses, dlogits, half="bf16")
            else:  # fp32; fp16 scales dlogits by the loss scale before rounding (backward)
                dlogits = xp.empty_like(logits)
                self.K.crossentropy_forward_backward(logits, targets, losses, dlogits, version=self.ver["crossentropy"])
            loss = losses.mean() if device_loss else float(losses.mean())
            self._cache = dict(
                B=B, T=T, idx=idx, blocks=blocks, h=h, meanf=meanf, rstdf=rstdf, lnf_mm=lnf_mm, dlogits=dlogits
            )
        return (None if logits is None else logits.reshape(B, T, V)), loss

    def backward(self, loss_scale=1.0, grads_ready=None):
        """Every gradient of the last forward's loss (times loss_scale) written into self.grads; grads_ready(k) right
        after the launches that finish layer k's (k indexes params.layer_segments: L + 1 the final LayerNorm, 1 + l
        block l, 0 the embeddings): work queued next on the current stream sees them final."""
        cfg = self.cfg
        c = self._cache
        if c is None:
            raise RuntimeError("backward: call forward(x, y) with targets first")
        if self.offload is not None:
            self.offload.backward_started()
        self._cache = None
        B, T = c["B"], c["T"]
        if "dlnf" in c:  # ce_chunks > 1: the head's products ran in forward (_head_chunked), for c["scale"]
            dlnf = c.pop("dlnf")
            if loss_scale != c["scale"]:  # micro-batches (1 / K): the rest of the factor, on dlnf and dwte (head)
                dlnf *= np.float32(loss_scale / c["scale"])
                self.grads["wte"] *= np.float32(loss_scale / c["scale"])
        else:
            dlnf = self._head_backward(c, loss_scale)
        dx = self._layernorm_backward(dlnf, c["h"], c["meanf"], c["rstdf"], "lnfw", "lnfb", None)
        ready = grads_ready or (lambda k: None)
        ready(cfg.n_layer + 1)
        policy, k = parse_policy(self.policy, cfg.n_layer)
        segment_of = {l: a for a, b in segments(cfg.n_layer, k) for l in range(a, b)} if policy == "sqrt" else {}
        held = {}  # sqrt: the recomputed caches of the segment backward is in, each dropped after its block's backward
        dres, dx_mm = self.ver["dres_out"] == "half", None  # the last block's dx has no half copy (see _block_backward)
        for l in reversed(range(cfg.n_layer)):
            blk = c["blocks"][l]
            if policy == "full":
                blk = self._block_forward(blk["x"], l, B, T, "none")[1]  # the recomputed output is not kept
            elif policy == "selective":
                self._rebuild(blk, l)
            elif policy == "sqrt":
                if l not in held:  # the segment's last block: its forward again from the segment's saved input
                    h = c["blocks"][segment_of[l]]["x"]
                    for j in range(segment_of[l], l + 1):
                        h, held[j] = self._block_forward(h, j, B, T, "none")
                    del h  # the segment's output (the next segment's saved input, or the kept lnf input)
                blk = held.pop(l)
            if dres:  # (dx, its half copy) from block to block
                dx, dx_mm = self._block_backward(dx, blk, l, B, T, dx_mm=dx_mm)
            else:
                dx = self._block_backward(dx, blk, l, B, T)
            ready(1 + l)
            c["blocks"][l] = None  # free the block's cache
            del blk  # (before the next recompute)
        # the embedding's share of dwte added to the head's (hip v3: in its last pass, no (V, C) scratch)
        self.K.encoder_backward(
            dx.reshape(B, T, cfg.d_model),
            c["idx"],
            self.grads["wte"],
            self.grads["wpe"][:T],
            version=self.ver["encoder"],
            accumulate=True,
        )
        if T < cfg.block_size:
            self.grads["wpe"][T:] = 0
        ready(0)

    def _head_backward(self, c, loss_scale):
        """The head's backward from the dlogits (B*T, V) the forward kept: dlnf (B*T, C) fp32, and the head's share of
        grads["wte"] written."""
        xp = self.xp
        dlogits = c["dlogits"]
        if self.precision == "fp16":  # scale before rounding to fp16: that is what keeps small values alive
            dl_mm = (dlogits * np.float32(loss_scale)).astype(xp.float16).view(xp.uint16)
            alpha = 1.0
        else:  # fp32: dlogits itself; bf16: already bf16 bits
            dl_mm, alpha = dlogits, loss_scale
        del dlogits, c["dlogits"]
        dlnf = xp.empty((c["B"] * c["T"], self.cfg.d_model), xp.float32)
        self._gemm(dl_mm, self._w("wte"), dlnf, alpha=alpha)  # dlnf = dlogits @ wte
        self._gemm(dl_mm, c["lnf_mm"], self.grads["wte"], trans_a=True, alpha=alpha)  # dwte (head) = dlogits.T @ lnf
        return dlnf

    def _head_chunked(self, lnf_mm, targets, grads=True):
        """The tied head and the loss over the N = B*T rows in ce_chunks chunks (reference/head.py has the math), so
        that only one chunk's logits and dlogits exist: per chunk (n rows) the logits (n, V) fp32 (cuBLAS), the fused
        cross-entropy kernel (the chunk's row losses and dlogits), then at once dlnf[chunk] = dlogits @ wte and
        grads["wte"] (+)= dlogits.T @ lnf[chunk] (the first chunk writes it, the others add: beta = 1). The loss
        kernels divide dlogits by the rows they see (n), the mean is over N: alpha = n / N in both products.
        Returns (losses (N,) fp32, dlnf (N, C) fp32; None with grads=False: the loss kernel alone per chunk).

        Half copies: in bf16 the loss kernel writes the chunk's dlogits as bf16 bits (no fp32 dlogits), the products'
        input, as without chunks (versions logits "half": over the chunk's bf16 logits, one buffer); in fp16 it
        writes fp32 dlogits, which are multiplied by the loss scale (and n / N) and rounded to fp16 chunk by chunk,
        right before the chunk's two products (without chunks: in backward, on the whole (N, V)). fp16 uses the loss
        scale of this step (self.scaler.scale), which backward applies when the head has not."""
        xp, V, N = self.xp, self.cfg.vocab_size, lnf_mm.shape[0]
        from ..reference.head import chunk_bounds

        bounds = chunk_bounds(N, self.ce_chunks)
        rows = bounds[0][1]  # the largest chunk (the first)
        half_logits = grads and self.ver["logits"] == "half"  # bf16 logits, the dlogits written over them
        logits_buf = xp.empty((rows, V), xp.uint16 if half_logits else xp.float32)
        losses = xp.empty(N, xp.float32)
        if not grads:
            for lo, hi in bounds:
                logits = logits_buf[: hi - lo]
                self._gemm(lnf_mm[lo:hi], self._w("wte"), logits, trans_b=True)  # lnf[chunk] @ wte.T
                self.K.crossentropy_forward(logits, targets[lo:hi], losses[lo:hi], version=self.ver["crossentropy"])
            return losses, None
        dlnf = xp.empty((N, self.cfg.d_model), xp.float32)
        if half_logits:
            dl_buf = logits_buf
        else:
            dl_buf = xp.empty((rows, V), xp.uint16 if self.precision == "bf16" else xp.float32)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        for i, (lo, hi) in enumerate(bounds):
            logits, dlogits, t = logits_buf[: hi - lo], dl_buf[: hi - lo], targets[lo:hi]
            self._gemm(lnf_mm[lo:hi], self._w("wte"), logits, trans_b=True)  # lnf[chunk] @ wte.T
            if self.precision == "bf16":
                self.K.crossentropy_forward_backward_half(logits, t, losses[lo:hi], dlogits, half="bf16")
            else:
                self.K.crossentropy_forward_backward(
                    logits, t, losses[lo:hi], dlogits, version=self.ver["crossentropy"]
                )
            alpha = (hi - lo) / N  # the kernel's 1 / n made the batch's 1 / N
            if self.precision == "fp16":
                dl_mm, alpha = (dlogits * np.float32(scale * alpha)).astype(xp.float16).view(xp.uint16), 1.0
            else:
                dl_mm = dlogits
            self._gemm(dl_mm, self._w("wte"), dlnf[lo:hi], alpha=alpha)  # dlnf[chunk] = dlogits @ wte
            beta = 0.0 if i == 0 else 1.0  # dwte (head) = sum over the chunks of dlogits.T @ lnf[chunk]
            self._gemm(dl_mm, lnf_mm[lo:hi], self.grads["wte"], trans_a=True, alpha=alpha, beta=beta)
            del dl_mm
        return losses, dlnf

    def grad_sumsq(self, g=None) -> float:
        """The squared L2 norm of `g` (default: the flat gradient buffer): one kernel over it (deterministic)."""
        self.K.grad_sumsq(self.grads.flat if g is None else g, self._sumsq)
        return float(self._sumsq[0])

    def count_nonfinite(self, g=None) -> int:
        """How many values of `g` (default: the gradient buffer) are inf or NaN: one pass (nonfinite_count)."""
        self.K.nonfinite_count(self.grads.flat if g is None else g, self._count)
        return int(self._count[0])

    def _half_copy(self):
        return self.half

    def _decay_of(self, lo, hi):
        from ..runtime.arrays import to_backend
        from ..kernels.numba.adamw import decay_table
        from ..model.optim import shard_decay_table

        b, f = shard_decay_table(*decay_table(self.params, arrays="numpy"), lo, hi)
        where = "cupy" if self.on_gpu else "numpy"
        return to_backend(b, where), to_backend(f, where)

    # ---- int8 moments: the per-block scales beside m and v ------------------------------------------------------
    def _int8_scales(self) -> dict:
        """{"m_scale", "v_scale"}: the per-block scales of int8 moments, else {}."""
        return {} if self.m_scale is None else {"m_scale": self.m_scale, "v_scale": self.v_scale}

    def _int8_args(self) -> dict:
        """The AdamW launchers' int8 keywords: the scales; in the CUDA simulator 64 threads per block (each simulated
        thread runs in Python: a quarter of the threads does the same work with fewer thread start-ups)."""
        sim = {} if self.on_gpu or self.m_scale is None else {"threads": 64}
        return {**self._int8_scales(), **sim}

    def _moments_state(self) -> dict:
        out = super()._moments_state()  # int8: the codes as stored (int8 m, uint8 sqrt(v)), then their scales
        return {**out, **{k: self._host(a) for k, a in self._int8_scales().items()}}

    def _load_int8_scales(self, moments: dict) -> None:
        for k, a in self._int8_scales().items():
            if np.shape(moments[k]) != a.shape:
                raise ValueError(f"load_state_dict: {k} has shape {np.shape(moments[k])}, this model needs {a.shape}")
            a[...] = self._dev(np.asarray(moments[k], np.float32))

    def optimizer_bytes(self) -> int:
        """Bytes of AdamW's moments as this engine holds them (int8: the codes and the per-block scales)."""
        return super().optimizer_bytes() + sum(int(a.nbytes) for a in self._int8_scales().values())

    def _adamw(self, st, lr, weight_decay, grad_scale):
        if self.offload is not None:  # on the CPU, over the host's master copy (engine/offload.py)
            return self.offload.step(lr, weight_decay, grad_scale, self.t, self.betas, self.eps)
        self.K.adamw_step(
            st.params,
            st.grads,
            st.m,
            st.v,
            lr,
            self.betas[0],
            self.betas[1],
            self.eps,
            weight_decay,
            self.t,
            decay_bounds=st.decay,
            grad_scale=grad_scale,
            half_out=st.half,
            half_dtype={"bf16": "bfloat16", "fp16": "float16"}.get(self.precision) if st.half is not None else None,
            version=self.ver["adamw"],
            **self._int8_args(),
        )

    def _grad_scale(self, sumsq, scale, grad_clip) -> float:
        """The clip factor over the loss scale in float32, operation for operation as adamw_step_device computes it
        from hyper and the squared norm on the GPU (min(1, clip / (sqrt(sumsq) / scale + 1e-6)) / scale), so a step
        launched from Python and its CUDA-graph replay update with the same factor (float64 and float32 arithmetic
        differ in the last bit, and Adam's first steps, an update of about lr * sign(g), amplify that)."""
        f = np.float32
        inv, coef = f(1.0 / scale), f(1.0)
        if grad_clip > 0:
            c = f(grad_clip) / (f(np.sqrt(f(max(float(sumsq), 0.0)))) * inv + f(1e-6))
            coef = min(coef, c)
        return float(coef * inv)

    def _hyper(self, lr, weight_decay, grad_clip):
        """The graph step's update policy on the host: the step count advances and AdamW's scalars (lr, lr * wd, bias
        corrections, clip threshold) go to adamw_step_device through GPU memory (StepGraph replays fixed launches)."""
        from ..contracts.adamw import adamw_hyper

        self.t += 1
        return adamw_hyper(lr, weight_decay, self.t, *self.betas, clip=float(grad_clip) if grad_clip > 0 else 0.0)

    def _update_on_device(self, hyper):
        """The update of _hyper's scalars, all on the GPU: the squared norm into _sumsq, the clip factor computed by
        AdamW from it (the same clip_coefficient), AdamW over the whole buffer (the graph step: fp32 / bf16, no scaler)."""
        st = self.optimizer_state()
        self.K.grad_sumsq(st.grads, self._sumsq)
        self.K.adamw_step_device(
            st.params,
            st.grads,
            st.m,
            st.v,
            hyper,
            self._sumsq,
            self.betas[0],
            self.betas[1],
            self.eps,
            decay_bounds=st.decay,
            half_out=st.half,
            half_dtype="bfloat16" if self.precision == "bf16" else None,
            **self._int8_args(),
        )

    def train_step(self, x, y, lr, weight_decay=0.0, grad_clip=0.0, reduce_grads=None, micro_batches=1) -> dict:
        """Forward, backward, clip, AdamW. fp16: a step with an inf/NaN gradient is skipped and the scale backs off.

        reduce_grads(grads_flat): called between backward and the update (data parallel: the all-reduce and the 1/N
        that turn this rank's gradient into the mean over ranks); the norm, clipping and AdamW then see its result.
        With graphs on (build(graphs=...)), the first step of each batch shape (B, T) captures the whole step as a
        CUDA graph (StepGraph) and every step replays it: one launch instead of a few hundred from Python (with
        reduce_grads: two graphs, backward's and the update's, with reduce_grads run between them). Results equal
        the eager step's (the same kernels; lr, the step count and the clip threshold are read by AdamW from GPU
        memory, adamw_step_device). Profiling turns graphs off (every launch is timed from Python).
        micro_batches=K: gradient accumulation over K blocks of rows (forward_backward), launched from Python (the
        captured step holds one forward and backward)."""
        if micro_batches != 1 and self._graphs_required:
            raise EngineError(
                "train_step: micro_batches > 1 (gradient accumulation) runs step by step from Python; "
                "this engine was built with graphs='on'"
            )
        if self.graphs and self.profiler is None and micro_batches == 1:
            x, y = self._check_batch("train_step", x, y)
            key = (*x.shape, reduce_grads is not None)
            graph = self._graphs.get(key)
            if graph is None:
                try:
                    graph = self._graphs[key] = StepGraph(self, *x.shape, split=reduce_grads is not None)
                except Exception as e:  # noqa: BLE001 - a platform without stream capture: say so, run eagerly
                    if self._graphs_required:
                        raise EngineError(f"capturing the training step as a CUDA graph failed: {e}") from e
                    import warnings

                    warnings.warn(
                        f"CUDA graph capture failed ({type(e).__name__}: {e}); training step by step "
                        f"from Python instead",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    self.graphs = False
                    graph = None
            if graph is not None:
                return graph.step(x, y, lr, weight_decay, grad_clip, reduce_grads)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        # offload_optimizer: each layer's gradients start their copy to the host as backward finishes them (after a
        # data-parallel all-reduce they are copied whole, in the update)
        ready = self._ready_kw(self.offload.grads_ready if self.offload is not None and reduce_grads is None else None)
        if micro_batches == 1:  # the phases as their own NVTX ranges (the step timeline shows them)
            with nvtx_range("forward"):
                loss = self.forward(x, y)[1]  # the logits are not kept: (B, T, V) would stay alive through backward
            with nvtx_range("backward"):
                self.backward(loss_scale=scale, **ready)
        else:
            with nvtx_range("micro-batches"):
                loss = self.forward_backward(x, y, micro_batches, loss_scale=scale, **ready)
        if reduce_grads is not None:
            reduce_grads(self.grads.flat)
        with nvtx_range("optimizer"):
            return {"loss": loss, **self.optimizer_step(lr, weight_decay, grad_clip)}

    def graph_pool_bytes(self) -> int:
        """Bytes the captured steps' private memory pools hold (0 without graphs)."""
        return sum(g.pool_bytes() for g in self._graphs.values())

    def eval_loss(self, x, y) -> float:
        x, y = self._check_batch("eval_loss", x, y)
        _, loss = self._forward(x, y, keep="full", grads=False)
        self._cache = None
        return loss

    def next_logits(self, context) -> np.ndarray:
        x, _ = self._check_batch("next_logits", np.asarray(context)[None, :])
        logits, _ = self._forward(x, None, keep="full")
        last = logits[0, -1]
        return np.asarray(self.xp.asnumpy(last) if self.on_gpu else last, dtype=np.float64)
