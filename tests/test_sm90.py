"""kernels/sm90 (runtime/sm90.py): Hopper's warpgroup matrix product, and flash attention v7 built on it.

Without a GPU: wgmma.cu and flash_v7.cu compile with NVRTC for sm_90a, and ptxas refuses it for plain sm_90 (why runtime/sm90.py
compiles cubins itself instead of going through CuPy's RawModule); bad arguments and a GPU that is not a Hopper are
named. On an H100 / H200: the wgmma product equals NumPy's on fresh random inputs, over several tiles of C and
several chunks of K, with A read from shared memory or from registers and B given as (N, K) or
(K, N), and a second call into the same output leaves nothing of the first; v7's forward (out, lse), its dK dV
alone (twice with the same bits, dq's columns untouched) and its whole backward (dQ writing delta, then dK dV) equal
the float64 reference's (lesson 01's attention) within v6's tolerance at T = 64 (one tile), 256 and 1024.
"""

import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.checks.flash import reference
from gpullm_lessons.runtime import sm90

from test_blaslt import bits, wide
from test_hip_flash import TOL, rel_err


@pytest.mark.parametrize("name", ["wgmma", "flash_v7"])
def test_compiles_for_sm90a_and_plain_sm90_refuses_it(name):
    pytest.importorskip("cuda.bindings", reason="NVRTC bindings come with the [dev] extra (numba-cuda[cu13])")
    ok, log = sm90.compile_check(name)
    assert ok, log
    ok, log = sm90.compile_check(name, arch="sm_90")
    assert not ok and "wgmma" in log and "not supported on .target 'sm_90'" in log, log


@pytest.mark.parametrize(
    "a, b, said",
    [
        (np.zeros((64, 64), np.float32), np.zeros((64, 64), np.uint16), "a must be a 2-D array of bf16 bits"),
        (np.zeros((64, 64), np.uint16), np.zeros((64,), np.uint16), "b must be a 2-D array of bf16 bits"),
        (np.zeros((64, 128), np.uint16), np.zeros((64, 64), np.uint16), r"second dimensions \(K\) differ"),
        (np.zeros((96, 64), np.uint16), np.zeros((64, 64), np.uint16), "M = 96 must be a positive multiple of 64"),
        (np.zeros((64, 64), np.uint16), np.zeros((32, 64), np.uint16), "N = 32 must be a positive multiple of 64"),
        (np.zeros((64, 48), np.uint16), np.zeros((64, 48), np.uint16), "K = 48 must be a positive multiple of 64"),
        (np.zeros((64, 128), np.uint16)[:, ::2], np.zeros((64, 64), np.uint16), "a must be C-contiguous"),
    ],
)
def test_bad_arguments_are_named(a, b, said):
    with pytest.raises((TypeError, ValueError), match=said):
        sm90.wgmma_gemm(a, b)


def test_b_as_k_by_n_is_checked_as_such():
    a, b = np.zeros((64, 128), np.uint16), np.zeros((128, 192), np.uint16)
    assert sm90._check_gemm(a, b, None, b_kn=True) == (64, 192, 128)
    with pytest.raises(ValueError, match=r"a's columns and b's rows \(K\) differ"):
        sm90._check_gemm(a, b.T.copy(), None, b_kn=True)


def test_a_wrong_out_is_named():
    a = np.zeros((64, 64), np.uint16)
    with pytest.raises(TypeError, match="wgmma_gemm: out has dtype float64, expected float32"):
        sm90.wgmma_gemm(a, a, out=np.zeros((64, 64), np.float64))
    with pytest.raises(ValueError, match=r"wgmma_gemm: out has shape \(64, 32\), expected \(64, 64\)"):
        sm90.wgmma_gemm(a, a, out=np.zeros((64, 32), np.float32))


@pytest.mark.skipif(device.kind() == "cuda", reason="this machine has an NVIDIA GPU")
def test_without_a_hopper_the_error_says_so():
    a = np.zeros((64, 64), np.uint16)
    with pytest.raises(sm90.NotHopperError, match=f"H100, H200.*this machine: {device.kind()}"):
        sm90.wgmma_gemm(a, a)


needs_hopper = pytest.mark.skipif(not sm90.is_hopper(), reason=f"needs an H100 / H200 (this machine: {device.kind()})")


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("b_kn", [False, True], ids=["b_nk", "b_kn"])
@pytest.mark.parametrize("a_regs", [False, True], ids=["a_smem", "a_regs"])
@pytest.mark.parametrize("M, N, K", [(64, 64, 64), (128, 192, 320), (320, 128, 1024)])
def test_gpu_wgmma_product_matches_numpy(M, N, K, a_regs, b_kn):
    import cupy as cp

    rng = np.random.default_rng(M + N + K)
    out = cp.full((M, N), np.nan, dtype=cp.float32)
    for call in range(2):  # the second call writes over the first's result: every element must be its own
        a, b = bits(rng.standard_normal((M, K))), bits(rng.standard_normal((N, K)))
        bb = np.ascontiguousarray(b.T) if b_kn else b
        got = sm90.wgmma_gemm(cp.asarray(a), cp.asarray(bb), out=out, b_kn=b_kn, a_regs=a_regs)
        got = cp.asnumpy(got).astype(np.float64)
        want = wide(a) @ wide(b).T  # the bf16 values multiplied exactly, summed in float64
        err = np.abs(got - want)
        where = np.unravel_index(int(np.argmax(err)), err.shape)
        # float32 accumulation of K products of size ~1: errors ~1e-6 sqrt(K); a wrong layout is off by ~sqrt(K)
        assert err.max() <= 1e-4 * np.sqrt(K), (call, where, got[where], want[where])


# ---- flash attention v7's dK dV (kernels/sm90/flash_v7.cu) -------------------------------------------------------


def v7_args(B=1, nh=2, T=128, hs=64):
    C = nh * hs
    return dict(
        qkv=np.zeros((B, T, 3 * C), np.uint16),
        dout=np.zeros((B, T, C), np.uint16),
        lse=np.zeros((B, nh, T), np.float32),
        delta=np.zeros((B, nh, T), np.float32),
        dqkv=np.zeros((B, T, 3 * C), np.float32),
    )


@pytest.mark.parametrize(
    "change, said",
    [
        (dict(qkv=np.zeros((1, 128, 3 * 2 * 32), np.uint16)), "not 3 x 2 heads x 64"),
        (dict(qkv=np.zeros((1, 128, 384), np.float32)), "qkv must be .B, T, 3C. bf16 bits"),
        (dict(qkv=np.zeros((1, 100, 384), np.uint16)), "T = 100 must be a multiple of 64"),
        (dict(dout=np.zeros((1, 128, 192), np.uint16)), r"dout has shape \(1, 128, 192\), expected \(1, 128, 128\)"),
        (dict(lse=np.zeros((1, 2, 128), np.float64)), "lse has dtype float64, expected float32"),
        (dict(dqkv=np.zeros((1, 128, 128), np.float32)), r"dqkv has shape \(1, 128, 128\), expected \(1, 128, 384\)"),
    ],
)
def test_v7_bad_arguments_are_named(change, said):
    args = {**v7_args(), **change}
    with pytest.raises((TypeError, ValueError), match=said):
        sm90.flash_backward_dkdv_v7(**args, nh=2)


def packed(x):
    """(B, nh, T, hs) -> (B, T, nh hs): the engine's rows."""
    B, nh, T, hs = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(B, T, nh * hs))


def heads(x, nh):
    B, T, C = x.shape
    return x.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3)


def v7_case(B, nh, T, seed):
    """Fresh bf16 q, k, v, dout (B, nh, T, 64) as bits, and qkv packed as the engine's rows (NumPy)."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (bits(rng.standard_normal((B, nh, T, sm90.V7_HS))) for _ in range(4))
    return q, k, v, do, np.concatenate([packed(q), packed(k), packed(v)], axis=-1)


def test_the_packed_rows_hold_each_head_where_the_kernels_read_it():
    """The GPU tests' own layout helpers: head h of q at columns h*64 .. of qkv's first C, k and v after it."""
    q, k, v, _, qkv = v7_case(2, 3, 128, seed=0)
    C = 3 * sm90.V7_HS
    for i, x in enumerate((q, k, v)):
        assert np.array_equal(heads(qkv[..., i * C : (i + 1) * C], 3), x)
    assert np.array_equal(qkv[1, 5, C + 2 * 64 : C + 3 * 64], k[1, 2, 5])  # batch 1, row 5, head 2 of k
    assert rel_err(np.ones(3), np.ones(3)) == 0 and rel_err(np.zeros(3), np.full(3, 0.01)) == pytest.approx(0.1)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("B, nh, T", [(1, 1, 64), (2, 3, 256), (1, 12, 1024)])
def test_gpu_flash_v7_dkdv_matches_the_reference(B, nh, T):
    import cupy as cp

    hs = sm90.V7_HS
    q, k, v, do, qkv = v7_case(B, nh, T, seed=B * 1000 + nh * 10 + T)
    out, lse, _, dk, dv = reference(wide(q), wide(k), wide(v), wide(do))
    delta = (wide(do) * out).sum(-1)
    dqkv = cp.full((B, T, 3 * nh * hs), np.nan, cp.float32)
    args = [cp.asarray(x) for x in (qkv, packed(do), lse.astype(np.float32), delta.astype(np.float32))]
    runs = []
    for _ in range(2):  # the second run gives the same bits
        sm90.flash_backward_dkdv_v7(*args, dqkv, nh=nh)
        runs.append(cp.asnumpy(dqkv))
    assert np.array_equal(runs[0], runs[1], equal_nan=True)
    got = runs[0]
    C = nh * hs
    assert np.isnan(got[..., :C]).all()  # dq's columns are not this kernel's
    for name, g, w in (("dk", heads(got[..., C : 2 * C], nh), dk), ("dv", heads(got[..., 2 * C :], nh), dv)):
        # P and dS rounded to bf16 for the products, as v6 does: tests/test_hip_flash.py's tolerance
        err, where = rel_err(g, w), np.unravel_index(int(np.nanargmax(np.abs(g - w))), g.shape)
        assert err < TOL["bf16"], (name, err, where)
    assert rel_err(dk, dv) > 3 * TOL["bf16"]  # dk and dv swapped would fail


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("B, nh, T", [(1, 1, 64), (2, 3, 256), (1, 12, 1024)])
def test_gpu_flash_v7_backward_matches_the_reference(B, nh, T):
    """The whole backward: dQ (which writes delta from out in bf16), then dK dV."""
    import cupy as cp

    hs = sm90.V7_HS
    q, k, v, do, qkv = v7_case(B, nh, T, seed=B * 1000 + nh * 10 + T + 1)
    out, lse, dq, dk, dv = reference(wide(q), wide(k), wide(v), wide(do))
    out_bits = packed(bits(out))
    delta = cp.full((B, nh, T), np.nan, cp.float32)
    dqkv = cp.full((B, T, 3 * nh * hs), np.nan, cp.float32)
    args = [cp.asarray(x) for x in (qkv, out_bits, packed(do), lse.astype(np.float32))]
    sm90.flash_backward_v7(*args, delta, dqkv, nh=nh)
    got, C = cp.asnumpy(dqkv), nh * hs
    want_delta = (wide(do) * wide(bits(out))).sum(-1)
    assert np.abs(cp.asnumpy(delta) - want_delta).max() <= 1e-4 * max(1.0, float(np.abs(want_delta).max()))
    parts = {"dq": (got[..., :C], dq), "dk": (got[..., C : 2 * C], dk), "dv": (got[..., 2 * C :], dv)}
    for name, (g, w) in parts.items():
        err = rel_err(heads(g, nh), w)
        assert err < TOL["bf16"], (name, err)


def test_v7_backward_names_a_wrong_out():
    args = v7_args()
    with pytest.raises(TypeError, match="flash v7 backward: out has dtype float32, expected uint16"):
        sm90.flash_backward_v7(out=np.zeros((1, 128, 128), np.float32), **args, nh=2)


def test_v7_forward_names_a_wrong_argument():
    args = v7_args()
    with pytest.raises(ValueError, match=r"flash v7 forward: lse has shape \(1, 128, 2\), expected \(1, 2, 128\)"):
        sm90.flash_forward_v7(args["qkv"], args["dout"], np.zeros((1, 128, 2), np.float32), nh=2)
    with pytest.raises(ValueError, match="T = 100 must be a multiple of 64"):
        sm90.flash_forward_v7(np.zeros((1, 100, 384), np.uint16), args["dout"], args["lse"], nh=2)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("B, nh, T", [(1, 1, 64), (2, 3, 256), (1, 12, 1024)])
def test_gpu_flash_v7_forward_matches_the_reference(B, nh, T):
    import cupy as cp

    hs = sm90.V7_HS
    q, k, v, _, qkv = v7_case(B, nh, T, seed=B * 1000 + nh * 10 + T + 2)
    want_out, want_lse = reference(wide(q), wide(k), wide(v))
    qkv = cp.asarray(qkv)
    out = cp.zeros((B, T, nh * hs), cp.uint16)
    lse = cp.full((B, nh, T), np.nan, cp.float32)
    sm90.flash_forward_v7(qkv, out, lse, nh=nh)
    got_out = heads(wide(cp.asnumpy(out)), nh)
    err = rel_err(got_out, want_out)
    assert err < TOL["bf16"], ("out", err)  # P rounded to bf16 for the product, out rounded to bf16
    assert np.abs(cp.asnumpy(lse) - want_lse).max() < 1e-3 * max(1.0, float(np.abs(want_lse).max()))
