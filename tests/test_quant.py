"""Block-wise 8-bit moments (gpullm_lessons.model.quant) and the NumPy engine's optimizer_state="int8" (lesson 12)."""

import math

import numpy as np
import pytest

from gpullm_lessons import engine, train
from gpullm_lessons.model import quant
from gpullm_lessons.model.params import GPTConfig, num_params

TOY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)


@pytest.mark.parametrize("n, block", [(1000, 256), (256, 256), (7, 4), (1, 256), (0, 64)])
def test_round_trip_error_is_at_most_half_a_level_of_each_block(n, block):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))).astype(np.float32)
    q, s = quant.quantize_blockwise(x, block)
    assert q.dtype == np.int8 and q.shape == (n,) and s.shape == (math.ceil(n / block),)
    back = quant.dequantize_blockwise(q, s, block)
    for b in range(s.size):
        part = slice(b * block, (b + 1) * block)
        assert s[b] == np.abs(x[part]).max()
        assert np.abs(back[part] - x[part]).max() <= s[b] / 127 / 2 * (1 + 1e-6)
    u, su = quant.quantize_blockwise(np.abs(x), block, signed=False)
    assert u.dtype == np.uint8
    back = quant.dequantize_blockwise(u, su, block, signed=False)
    for b in range(su.size):
        part = slice(b * block, (b + 1) * block)
        assert np.abs(back[part] - np.abs(x[part])).max() <= su[b] / 255 / 2 * (1 + 1e-6)


def test_an_outlier_spoils_only_its_block():
    x = np.full(512, 1e-3, np.float32)
    x[3] = 100.0
    back = quant.dequantize_blockwise(*quant.quantize_blockwise(x, 256), 256)
    assert np.all(back[1:256][back[1:256] != 100.0] == 0)  # block 0: 1e-3 is below half a level of 100 / 127
    np.testing.assert_allclose(back[256:], x[256:], rtol=1e-6)  # block 1: exact (every value is the absmax)
    one = quant.dequantize_blockwise(*quant.quantize_blockwise(x, 512), 512)
    assert np.all(one[256:] == 0)  # one scale for everything: the outlier zeroes the whole tensor


def test_an_all_zero_block_reads_back_as_zeros():
    x = np.zeros(300, np.float32)
    x[280] = -2.0
    q, s = quant.quantize_blockwise(x, 256)
    assert s[0] == 0 and np.all(quant.dequantize_blockwise(q, s, 256)[:256] == 0)
    assert quant.dequantize_blockwise(q, s, 256)[280] == -2.0


def test_moments_keep_v_non_negative_and_never_zero():
    rng = np.random.default_rng(0)
    m = rng.standard_normal(1000).astype(np.float32) * 1e-3
    v = (rng.standard_normal(1000) ** 2 * 1e-6).astype(np.float32)
    v[5] = 0.0
    state = quant.quantize_moments(m, v)
    m2, v2 = quant.dequantize_moments(state)
    assert np.all(v2 > 0)  # level 0 reads as half a level: no division by eps alone
    assert np.abs(np.sqrt(v2) - np.sqrt(v)).max() <= state["v_scale"].max() / 255 * (1 + 1e-6)
    assert np.abs(m2 - m).max() <= state["m_scale"].max() / 127 / 2 * (1 + 1e-6)
    assert sum(a.nbytes for a in state.values()) == quant.moment_bytes(1000) == 2 * 1000 + 8 * 4


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="flat"):
        quant.quantize_blockwise(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="block must be a positive int"):
        quant.quantize_blockwise(np.zeros(3, np.float32), 0)
    with pytest.raises(ValueError, match="values >= 0 only"):
        quant.quantize_blockwise(np.array([1.0, -1.0], np.float32), signed=False)
    q, s = quant.quantize_blockwise(np.ones(10, np.float32), 4)
    with pytest.raises(ValueError, match="need 3 scales"):
        quant.dequantize_blockwise(q, s[:2], 4)


# ---- the engine and the job --------------------------------------------------------------------------------------


def _batches(n):
    rng = np.random.default_rng(7)
    xs = [rng.integers(0, 32, (4, 8)).astype(np.int32) for _ in range(n)]
    return [(x, (x + 1) % 32) for x in xs]  # a rule the model can learn: the next id


def test_int8_moments_train_like_fp32_in_a_quarter_of_the_bytes():
    f32, i8 = engine.build(TOY, "numpy"), engine.build(TOY, "numpy", optimizer_state="int8")
    n = num_params(TOY)
    assert f32.optimizer_bytes() == 8 * n and i8.optimizer_bytes() == quant.moment_bytes(n) < 0.27 * 8 * n
    la, lb = [], []
    for x, y in _batches(30):
        la.append(f32.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)["loss"])
        lb.append(i8.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)["loss"])
    assert lb[-1] < lb[0] - 0.3  # it learns
    assert abs(np.mean(lb[-5:]) - np.mean(la[-5:])) < 0.05 * np.mean(la[-5:])  # close to the fp32 run
    assert not np.array_equal(i8.params.flat, f32.params.flat)  # and it is not the fp32 update itself
    # a checkpoint holds the moments as stored (int8 m, uint8 sqrt(v), the block scales): a resume is exact
    st = i8.state_dict()
    assert st["optimizer_state"] == "int8" and st["m"].dtype == np.int8 and st["v"].dtype == np.uint8
    assert st["m"].shape == (n,) and st["m_scale"].shape == (math.ceil(n / quant.BLOCK),)
    other = engine.build(TOY, "numpy", optimizer_state="int8", seed=5)
    other.load_state_dict(st)
    assert all(np.array_equal(other.moments_q[k], i8.moments_q[k]) for k in i8.moments_q)
    x, y = _batches(1)[0]
    la = i8.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)["loss"]
    lb = other.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)["loss"]
    assert la == lb and np.array_equal(i8.params.flat, other.params.flat)
    # an fp32 engine resumes it too: the moments read back to fp32 (quant.dequantize_moments)
    f32b = engine.build(TOY, "numpy")
    f32b.load_state_dict(st)
    m_back, v_back = quant.dequantize_moments(st)
    assert np.array_equal(f32b.m, m_back) and np.array_equal(f32b.v, v_back)


def test_int8_moments_on_every_backend_and_unknown_states_refused():
    """The kernel backends keep int8 moments too (tests/test_optimizer_state_int8.py checks their kernels)."""
    eng = engine.build(TOY, "numba", optimizer_state="int8")
    assert (eng.m.dtype, eng.v.dtype, eng.m_scale.shape) == (np.int8, np.uint8, (math.ceil(eng.m.size / quant.BLOCK),))
    with pytest.raises(engine.EngineError, match="unknown optimizer_state 'int4'"):
        engine.build(TOY, "numpy", optimizer_state="int4")


def test_the_job_takes_optimizer_state(tmp_path):
    from test_train_ranks import TINY

    out = tmp_path / "i8"
    summary = train.main([str(a) for a in TINY] + ["--steps", "3", "--optimizer-state", "int8", "--out", str(out)])
    assert summary is not None and (out / "log.jsonl").exists()
    with pytest.raises(train.ConfigError, match="--zero with --optimizer-state int8"):
        train.main([str(a) for a in TINY] + ["--steps", "1", "--optimizer-state", "int8", "--zero",
                                              "--out", str(tmp_path / "z")])
