"""Each flash launcher's argument lists come from flash.cu itself (hip.launch_args), checked without a GPU.

The launchers of backends/hip/flash.py hand each kernel a dict of named values; hip.launch_args orders them by the
entry point's parameter list as flash.cu declares it and checks each against its C type. Here every launcher runs
on the CPU for every version, head size, format, layout and the fused backward, with NumPy stand-ins for the CuPy
arrays and a recorder in place of the compiled kernel: each recorded call must hand the kernel exactly its parameters,
in order, with the right dtypes. Then a source whose parameters disagree with the launcher (one added, one renamed,
one of another type) is planted and must be refused by name before anything launches.
"""

import re
import sys
import types

import numpy as np
import pytest

from gpullm_lessons.runtime import hip
from gpullm_lessons.backends.hip import flash as hflash

FLASH = hip.signatures(hip.source_path("flash").read_text())


def part_blocks(text: str) -> dict:
    """{part_options(version, half): the entry points inside its `#if FLASH_PART(V, H)` blocks; None: those outside
    every block (compiled in every part)}, read from flash.cu's text. Each version's section ends with its own blocks
    (v2's and v3's both in part 2, v5's fused backward's beside v5's in part 5): a part is the union of its blocks."""
    out = {}
    for m in re.finditer(r"#if FLASH_PART\((\d), (\d)\)[^\n]*\n(.*?)#endif", text, re.S):
        prefix = text[: m.start()]  # every macro a block uses is defined above it, in its section
        key = (f"-DFLASH_PART_V={m.group(1)}", f"-DFLASH_PART_H={m.group(2)}")
        out.setdefault(key, set()).update(set(hip.signatures(prefix + m.group(3))) - set(hip.signatures(prefix)))
    out[None] = set(hip.signatures(text)) - set().union(*out.values())
    return out


PART_BLOCKS = part_blocks(hip.source_path("flash").read_text())


class Dev(np.ndarray):
    """A NumPy array that passes for a CuPy one where the launchers look: .data.ptr (16-byte aligned)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=0)


def dev(shape, dtype):
    return np.zeros(shape, dtype).view(Dev)


@pytest.fixture
def recorded(monkeypatch):
    """The launchers with a recorder for every kernel: [(entry point, grid, block, args, kwargs)]."""
    calls = []

    def kernel(name, version, half):
        assert name in PART_BLOCKS[hflash.part_options(version, half)] | PART_BLOCKS[None], (name, version, half)
        return lambda grid, block, args, **kw: calls.append((name, grid, block, args, kw))

    fake_cupy = types.SimpleNamespace(
        empty=lambda shape, dtype: dev(shape, dtype),
        zeros=lambda n, dtype: dev(n, dtype),
        float32=np.float32,
        int32=np.int32,
        uint8=np.uint8,
    )
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(hflash, "_kernel", kernel)
    monkeypatch.setattr(hip, "warp_size", lambda device_id=0: 32)
    shapes = lambda fn, version, half, heads, rows, outs: (2, 3, 70, heads[0][1].shape[-1])  # noqa: E731
    monkeypatch.setattr(hflash, "_check", shapes)
    monkeypatch.setattr(
        hflash, "_check_packed", lambda fn, half, nh, pairs: (2, 70, nh, pairs[0][1].shape[2] // 3 // nh)
    )
    qk = lambda fn, queries, keys, rows, **kw: (*queries[0][1].shape[:3], keys[0][1].shape[2], keys[0][1].shape[3])  # noqa: E731
    monkeypatch.setattr(hflash, "check_flash_qk_args", qk)
    monkeypatch.setattr(hflash, "check_attention_mask", lambda fn, causal, mask, Tq, Tk, cupy: mask is not None)
    return calls


def run_heads(version, half, hs, fused=False):
    B, nh, T = 2, 3, 70
    q, k, v, dout = (dev((B, nh, T, hs), np.uint16) for _ in range(4))
    out, dq, dk, dv = (dev((B, nh, T, hs), np.float32) for _ in range(4))
    lse = dev((B, nh, T), np.float32)
    hflash.flash_attention_forward(q, k, v, out, lse, version=version, half=half)
    hflash.flash_attention_backward(q, k, v, out, dout, lse, dq, dk, dv, version=version, half=half, fused=fused)
    return {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def run_packed(version, half, hs, fused=False, half_grads=False):
    B, T, nh = 2, 70, 3
    C = nh * hs
    qkv, out, dout = dev((B, T, 3 * C), np.uint16), dev((B, T, C), np.uint16), dev((B, T, C), np.uint16)
    lse, dqkv = dev((B, nh, T), np.float32), dev((B, T, 3 * C), np.uint16 if half_grads else np.float32)
    hflash.flash_attention_forward_packed(qkv, out, lse, nh, half=half, version=version)
    hflash.flash_attention_backward_packed(qkv, out, dout, lse, dqkv, nh, half=half, version=version, fused=fused)
    return {"qkv": qkv, "out": out, "dout": dout, "lse": lse, "dqkv": dqkv}


def run_general(half, hs, mask=True):
    """v3's general kernels: Tq = 70 queries, Tk = 90 keys, not causal, with or without a mask."""
    B, nh, Tq, Tk = 2, 3, 70, 90
    q, dout = (dev((B, nh, Tq, hs), np.uint16) for _ in range(2))
    k, v = (dev((B, nh, Tk, hs), np.uint16) for _ in range(2))
    out, dq = (dev((B, nh, Tq, hs), np.float32) for _ in range(2))
    dk, dv = (dev((B, nh, Tk, hs), np.float32) for _ in range(2))
    lse, m = dev((B, nh, Tq), np.float32), dev((Tq, Tk), np.uint8) if mask else None
    kw = {"version": "v3", "half": half, "causal": False, "mask": m}
    hflash.flash_attention_forward(q, k, v, out, lse, **kw)
    hflash.flash_attention_backward(q, k, v, out, dout, lse, dq, dk, dv, **kw)
    return {
        "q": q,
        "k": k,
        "v": v,
        "out": out,
        "dout": dout,
        "lse": lse,
        "dq": dq,
        "dk": dk,
        "dv": dv,
        **({"mask": m} if mask else {}),
    }


def general_plan(half, hs) -> list:
    sfx = "bf16" if half == "bf16" else "f16"
    return [
        f"flash_attention_forward_v3_general_hs{hs}_{sfx}",
        f"flash_attention_backward_v2_delta_{sfx}",
        f"flash_attention_backward_v3_general_dkdv_hs{hs}_{sfx}",
        f"flash_attention_backward_v3_general_dq_hs{hs}_{sfx}",
    ]


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("half", hflash.HALF_FORMATS)
@pytest.mark.parametrize("hs", hflash.HEAD_SIZES)
def test_every_general_launch_hands_its_kernel_exactly_the_declared_parameters(recorded, half, hs, mask):
    arrays = run_general(half, hs, mask)
    assert [c[0] for c in recorded] == general_plan(half, hs)
    for name, grid, _, args, _ in recorded:
        params = FLASH[name]
        assert len(args) == len(params), (name, params)
        values = dict(zip((p for _, p in params), args))
        for (ctype, pname), arg in zip(params, args):
            if pname in arrays:
                assert arg is arrays[pname], (name, pname)
            assert str(arg.dtype) == hip.PARAM_DTYPES[ctype], (name, ctype, pname, arg.dtype)
        if "Tq" in values:
            assert (values["Tq"], values["Tk"], values["causal"], values["has_mask"]) == (70, 90, 0, int(mask))
        rows = 90 if "_dkdv_" in name else 70  # dK dV's blocks own key rows, the others query rows
        assert "_delta_" in name or grid == (6, -(-rows // hflash.ROWS)), (name, grid)


CASES = [(v, False, False) for v in hflash.VERSIONS] + [(v, True, False) for v in hflash.PACKED]
CASES += [("v5", False, True), ("v5", True, True)]


@pytest.mark.parametrize("version, packed, fused", CASES)
@pytest.mark.parametrize("half", hflash.HALF_FORMATS)
@pytest.mark.parametrize("hs", hflash.HEAD_SIZES)
def test_every_launch_hands_its_kernel_exactly_the_declared_parameters(recorded, version, packed, fused, half, hs):
    arrays = (run_packed if packed else run_heads)(version, half, hs, fused)
    names = [c[0] for c in recorded]
    assert names[0] == hflash.forward_entry(version, half, hs, packed)
    assert names[1:] == [f for f, _ in hflash.backward_plan(version, half, hs, packed, fused)]
    for name, _, _, args, _ in recorded:
        params = FLASH[name]  # flash.cu's own list, parsed independently of the launcher's cache
        assert len(args) == len(params), (name, params)
        for (ctype, pname), arg in zip(params, args):
            if pname in arrays:  # the caller's own array, not a copy or another one
                assert arg is arrays[pname], (name, pname)
            want = hip.PARAM_DTYPES[ctype]
            assert str(arg.dtype) == want, (name, ctype, pname, arg.dtype)
            assert ctype.endswith("*") == (not isinstance(arg, np.generic)), (name, ctype, pname)


@pytest.mark.parametrize("half", hflash.HALF_FORMATS)
@pytest.mark.parametrize("hs", hflash.HEAD_SIZES)
def test_half_gradients_launch_the_hg_entry_points_with_their_parameters(recorded, half, hs):
    """dqkv in the half format (uint16): v6's _hg entry points, handed exactly their parameters, dqkv as given."""
    arrays = run_packed("v6", half, hs, half_grads=True)
    names = [c[0] for c in recorded]
    sfx = "bf16" if half == "bf16" else "f16"
    assert names[1:] == [
        f"flash_attention_backward_v6_packed_hg_dq_hs{hs}_{sfx}",
        f"flash_attention_backward_v6_packed_hg_dkdv_hs{hs}_{sfx}",
    ]
    assert names[1:] == [f for f, _ in hflash.backward_plan("v6", half, hs, packed=True, half_grads=True)]
    for name, _, _, args, _ in recorded[1:]:
        params = FLASH[name]
        assert len(args) == len(params), (name, params)
        for (ctype, pname), arg in zip(params, args):
            if pname in arrays:
                assert arg is arrays[pname], (name, pname)
            assert str(arg.dtype) == hip.PARAM_DTYPES[ctype], (name, ctype, pname, arg.dtype)
        assert ("unsigned short*", "dqkv") in params


@pytest.mark.parametrize("version", ["v4", "v5"])
def test_half_gradients_of_a_version_without_them_are_refused_by_name(recorded, version):
    with pytest.raises(ValueError, match=r"dqkv in the half format \(uint16\) is written by version v6"):
        run_packed(version, "bf16", 64, half_grads=True)
    with pytest.raises(ValueError, match="half gradients are written by v6 on the packed layout"):
        hflash.backward_plan("v6", "bf16", 64, packed=False, half_grads=True)


def test_the_backwards_run_in_each_versions_order(recorded):
    run_heads("v2", "bf16", 64)
    assert [c[0] for c in recorded[1:]] == [
        "flash_attention_backward_v2_delta_bf16",
        "flash_attention_backward_v2_dkdv_hs64_bf16",
        "flash_attention_backward_v2_dq_hs64_bf16",
    ]
    recorded.clear()
    run_heads("v6", "fp16", 32)
    assert [c[0] for c in recorded[1:]] == [
        "flash_attention_backward_v6_dq_hs32_f16",
        "flash_attention_backward_v6_dkdv_hs32_f16",
    ]
    # v2's dQ takes no `out` (v4's and later do): the bug of passing v6's list to v2 cannot come back
    v2, v6 = FLASH["flash_attention_backward_v2_dq_hs32_f16"], FLASH["flash_attention_backward_v6_dq_hs32_f16"]
    assert "out" not in [p for _, p in v2] and "out" in [p for _, p in v6]


def test_every_flash_entry_point_is_reached_by_a_launcher():
    """No entry point of flash.cu that the tests above never hand arguments to (a new version without a launcher)."""
    reached = set()
    for version, packed, fused in CASES:
        for half in hflash.HALF_FORMATS:
            for hs in hflash.HEAD_SIZES:
                reached.add(hflash.forward_entry(version, half, hs, packed))
                reached.update(f for f, _ in hflash.backward_plan(version, half, hs, packed, fused))
                reached.update(general_plan(half, hs))
                if packed and version in hflash.HALF_GRADS:
                    reached.update(f for f, _ in hflash.backward_plan(version, half, hs, True, half_grads=True))
    assert set(FLASH) == reached, sorted(set(FLASH) ^ reached)


def plant(monkeypatch, entry, old, new):
    """flash.cu with one parameter of `entry`'s macro changed, as the launcher would read it."""
    text = hip.source_path("flash").read_text()
    assert text.count(old) >= 1, old
    planted = hip.signatures(text.replace(old, new))
    assert planted[entry] != FLASH[entry]
    monkeypatch.setattr(hip, "signature", lambda name, function: planted[function])


@pytest.mark.parametrize(
    "old, new, words",
    [
        # v2's dQ given an `out` parameter (what v6's change did to v4-v6): its launcher passes exactly that now, so
        # the planted mismatch is a parameter the launcher has no value for
        (
            "const float* delta, float* dq, int T, float scale) {                                        \\\n"
            "        flash_dq<H, HS>",
            "const float* delta, float* dq_acc, int T, float scale) {                                    \\\n"
            "        flash_dq<H, HS>",
            ["takes float* dq_acc", "does not provide"],
        ),
        # a parameter of another type than the launcher's array: float32 where the kernel reads 16-bit bits
        (
            "const float* lse, const float* delta, float* dq, int T, float scale) {                                        \\\n"
            "        flash_dq<H, HS>",
            "const unsigned short* lse, const float* delta, float* dq, int T, float scale) {                               \\\n"
            "        flash_dq<H, HS>",
            ["unsigned short* lse", "needs an array of uint16", "float32"],
        ),
        # a scalar of another width: T as long long
        (
            "float* dq, int T, float scale) {                                        \\\n        flash_dq<H, HS>",
            "float* dq, long long T, float scale) {                                  \\\n        flash_dq<H, HS>",
            ["long long T", "needs a int64", "int32"],
        ),
    ],
    ids=["missing", "dtype", "width"],
)
def test_a_planted_mismatch_is_refused_by_name(recorded, monkeypatch, old, new, words):
    plant(monkeypatch, "flash_attention_backward_v2_dq_hs64_bf16", old, new)
    with pytest.raises(TypeError) as e:
        run_heads("v2", "bf16", 64)
    assert "flash_attention_backward_v2_dq_hs64_bf16" in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert all("_dq_" not in c[0] for c in recorded)  # refused before it launched


def test_each_part_holds_its_versions_entry_points_and_no_other():
    """The launchers compile one FLASH_PART block of flash.cu per version and format: every entry point is in exactly
    one block or outside all (the delta passes), and the blocks split 2 formats x 4 parts (v2 with v3)."""
    blocks = {k: v for k, v in PART_BLOCKS.items() if k}
    assert len(blocks) == 8 and sorted(PART_BLOCKS[None]) == sorted(n for n in FLASH if "_delta_" in n)
    seen = [n for v in PART_BLOCKS.values() for n in v]
    assert sorted(seen) == sorted(FLASH)  # each once
    for (pv, ph), names in blocks.items():
        versions = {re.search(r"_(v\d)_", n).group(1) for n in names}
        assert {hflash.PARTS[v] for v in versions} == {int(pv.split("=")[1])}, (pv, versions)
        assert {n.rsplit("_", 1)[1] for n in names} == {"bf16" if ph.endswith("1") else "f16"}


def test_signatures_parse_every_kernel_source():
    """Every entry point of every .cu file has a parameter list the parser reads, with known types (a type it cannot
    check would let a mismatch through)."""
    for path in hip.sources():
        sigs = hip.signatures(path.read_text())
        assert sigs, path.name
        for name, params in sigs.items():
            assert all(p.isidentifier() for _, p in params), (path.name, name, params)
            unknown = {t for t, _ in params} - set(hip.PARAM_DTYPES)
            if path.stem == "flash":
                assert not unknown, (name, unknown)
