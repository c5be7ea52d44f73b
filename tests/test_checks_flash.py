"""The flash attention checkers (gpullm_lessons/checks/flash.py): the right answer passes on fresh seeds; tile mistakes
are named for the tile width they used. (Every named mistake of the three checkers, played as a NumPy answer, gets its
own hint: tests/test_hints_named.py, for every task's checker.)"""

import numpy as np
import pytest

from gpullm_lessons.checks import flash as F
from gpullm_lessons.checks import opcheck

from conftest import wrong


def as_case(arrays, backward):
    """A checker Case around the arrays the checker passed (float64 copies in x), for replaying a mistake."""
    q = arrays[0]
    B, nh, T, hs = q.shape
    c = opcheck.Case(np.dtype(np.float32), {"B": B, "nh": nh, "T": T, "hs": hs})
    names = ("q", "k", "v", "out", "dout", "lse") if backward else ("q", "k", "v")
    c.x = {n: np.asarray(a, dtype=np.float64) for n, a in zip(names, arrays)}
    return c


@pytest.mark.parametrize("kw,words", [
    (dict(rescale_acc=False), ["running output is not rescaled"]),
    (dict(rescale_l=False), ["running sum l is not rescaled"]),
    (dict(rescale_acc=False, rescale_l=False), ["neither the running sum nor the running output"]),
    (dict(accumulate="seen"), ["last key tile"]),
    (dict(accumulate="always"), ["last key tile"]),
    (dict(accumulate="reset"), ["running state (m, l and acc) is set back"]),
    (dict(BR=32), ["tile skipping stops too early", "blocks of 32 rows"]),
])
@pytest.mark.parametrize("BC", [8, 16])
def test_tile_mistakes_name_the_step_and_the_tile_width(kw, words, BC):
    def fn(q, k, v, out, lse):
        out[...], lse[...] = F._tiled(as_case((q, k, v), False), BC, **kw)

    r = F.check_flash_attention_forward(fn, arrays="numpy", seed=11, quiet=True)
    # "always" and "reset" keep the last tile only: at T = 37 the last tile of 8 keys and of 16 both start at key 32
    # (the same output), so either width is a right name for it
    wrong(r, *words, "tiles of" if kw.get("accumulate") in ("always", "reset") else f"tiles of {BC} keys")


def test_the_right_tiled_replay_passes_for_every_tile_width():
    for BC in F.TILES:
        def fn(q, k, v, out, lse, BC=BC):
            out[...], lse[...] = F._tiled(as_case((q, k, v), False), BC)

        r = F.check_flash_attention_forward(fn, arrays="numpy", seed=BC, quiet=True)
        assert r.status == "correct", (BC, r.message)


def test_right_backward_passes_and_an_unwritten_output_is_named():
    def right(q, k, v, out, dout, lse, dq, dk, dv):
        g = F._expected_backward(as_case((q, k, v, out, dout, lse), True))
        dq[...], dk[...], dv[...] = g["dq"], g["dk"], g["dv"]

    assert F.check_flash_attention_backward(right, arrays="numpy", seed=3, quiet=True).status == "correct"

    def no_dv(q, k, v, out, dout, lse, dq, dk, dv):
        g = F._expected_backward(as_case((q, k, v, out, dout, lse), True))
        dq[...], dk[...] = g["dq"], g["dk"]

    wrong(F.check_flash_attention_backward(no_dv, arrays="numpy", seed=3, quiet=True), "dv", "never written")


def test_bad_checker_arguments_are_refused():
    with pytest.raises(TypeError, match="pass the function itself"):
        F.check_flash_attention_forward(42, arrays="numpy")
    with pytest.raises(ValueError, match="dtype"):
        F.check_flash_attention_forward(lambda *a: None, arrays="numpy", dtype="int8")


# ---- the forward on the engine's packed layout (exercise 11.4) ------------------------------------------------------
def packed_case(qkv, nh):
    B, T, C3 = qkv.shape
    C = C3 // 3
    c = opcheck.Case(np.dtype(np.float32), {"B": B, "nh": nh, "T": T, "hs": C // nh, "C": C, "3C": C3})
    c.x["qkv"] = np.asarray(qkv, np.float64)
    for i, name in enumerate(("q", "k", "v")):
        c.x[name] = np.ascontiguousarray(F._split(c.x["qkv"][..., i * C : (i + 1) * C], nh))
    return c


def packed_answer(mistake_outputs=None):
    def fn(qkv, out, lse, nh):
        c = packed_case(qkv, nh)
        right = F._expected_packed(c)
        bad = mistake_outputs(c) if mistake_outputs else {}
        out[...], lse[...] = bad.get("out", right["out"]), bad.get("lse", right["lse"])
    return fn


def test_the_right_packed_answer_passes():
    for seed in (1, 2, 3):
        r = F.check_flash_attention_forward_packed(packed_answer(), arrays="numpy", seed=seed, quiet=True)
        assert r.status == "correct", r.message


def test_the_packed_cases_have_the_offsets_and_the_tiles_in_them():
    """B and nh above 1 (a missing row or head offset shows), T past one tile of 8 and one block of 16 rows."""
    for size in ("small", "large"):
        shapes = F.PACKED_CASES[size]
        assert any(B > 1 and nh > 1 and T > 16 for B, nh, T, hs in shapes)
        assert shapes[0] == shapes[1]  # the same shape twice: a kernel that keeps state between calls fails


def test_packed_answers_wrong_past_one_block_or_on_a_second_call_fail():
    """A grid capped at one block of 16 rows leaves the rows after it unwritten; an answer that keeps state between
    calls (right on the first call only) fails on the repeated shape."""
    right = packed_answer()

    def capped(qkv, out, lse, nh):
        full_out, full_lse = np.full_like(out, np.nan), np.full_like(lse, np.nan)
        right(qkv, full_out, full_lse, nh)
        out[:, :16], lse[:, :, :16] = full_out[:, :16], full_lse[:, :, :16]

    wrong(F.check_flash_attention_forward_packed(capped, arrays="numpy", seed=5, quiet=True), "out")
    calls = []

    def stateful(qkv, out, lse, nh):
        right(qkv, out, lse, nh)
        if calls:
            out *= 1.01
        calls.append(1)

    wrong(F.check_flash_attention_forward_packed(stateful, arrays="numpy", seed=5, quiet=True), "out")
