"""GPTConfig, the parameter layout, ParamBuffer (one flat buffer, named views) and init_params."""
import math

import numpy as np
import pytest

from gpullm_lessons.model.params import (PARAM_NAMES, GPTConfig, ParamBuffer, init_params, num_params,
                                   param_shapes)

TINY = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, d_model=8)


def test_config_defaults_and_head_size():
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.d_model) == (256, 64, 2, 2, 64)
    assert cfg.head_size == 32


@pytest.mark.parametrize("kwargs, match", [
    ({"d_model": 10, "n_head": 3}, r"d_model=10 is not divisible by n_head=3"),
    ({"n_layer": 0}, r"n_layer must be positive, got 0"),
    ({"vocab_size": -5}, r"vocab_size must be positive"),
    ({"block_size": 8.0}, r"block_size must be an int"),
    ({"n_head": True}, r"n_head must be an int"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_param_shapes_order_and_count():
    shapes = param_shapes(TINY)
    assert tuple(shapes) == PARAM_NAMES == (
        "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
        "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")
    V, maxT, L, C = 17, 8, 2, 8
    assert shapes["wte"] == (V, C) and shapes["wpe"] == (maxT, C)
    assert shapes["qkvw"] == (L, C, 3 * C) and shapes["fcprojw"] == (L, 4 * C, C) and shapes["lnfb"] == (C,)
    n = sum(math.prod(s) for s in shapes.values())
    assert num_params(TINY) == n == V * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C
    cfg = GPTConfig()
    assert num_params(cfg) == 256 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    with pytest.raises(TypeError, match="expected a GPTConfig"):
        param_shapes({"vocab_size": 3})


def test_views_alias_the_flat_buffer():
    p = ParamBuffer(TINY)
    assert p.flat.ndim == 1 and p.flat.size == num_params(TINY) and p.flat.dtype == np.float32
    assert p.names == list(PARAM_NAMES) and len(p) == 16 and "qkvw" in p
    for name, shape in param_shapes(TINY).items():
        view = p[name]
        assert view.shape == shape and view.dtype == np.float32
        assert np.shares_memory(view, p.flat) and view.flags["C_CONTIGUOUS"]
    p["qkvw"][1, 2, 3] = 7.0                             # write through a view ...
    start, stop = p.offsets["qkvw"]
    assert p.flat[start + 1 * 8 * 24 + 2 * 24 + 3] == 7.0   # ... shows in the flat buffer
    p.flat[p.offsets["lnfb"][0]] = -3.0                  # write the flat buffer ...
    assert p["lnfb"][0] == -3.0                          # ... shows in the view
    p["wpe"] = 2.0                                       # __setitem__ copies into the view
    assert np.all(p.flat[slice(*p.offsets["wpe"])] == 2.0) and p.views["wpe"] is p["wpe"]


def test_offsets_tile_the_buffer_in_order():
    p = ParamBuffer(TINY, dtype=np.float64)
    position = 0
    for name in p.names:
        start, stop = p.offsets[name]
        assert start == position and stop - start == p[name].size
        position = stop
    assert position == p.flat.size
    p.flat[...] = np.arange(p.flat.size)
    assert p["wte"][0, 1] == 1 and p["lnfb"][-1] == p.flat.size - 1


def test_zeros_like_and_copy_are_independent():
    p = init_params(TINY)
    g = p.zeros_like()
    assert isinstance(g, ParamBuffer) and g.dtype == p.dtype and g.names == p.names
    assert np.all(g.flat == 0) and not np.shares_memory(g.flat, p.flat)
    c = p.copy()
    np.testing.assert_array_equal(c.flat, p.flat)
    c["wte"][0, 0] += 1.0
    assert c.flat[0] != p.flat[0]
    assert "ParamBuffer(16 tensors" in repr(p)


def test_parambuffer_rejects_integer_dtype():
    with pytest.raises(TypeError, match="dtype must be floating-point, got int32"):
        ParamBuffer(TINY, dtype=np.int32)


def test_init_params_deterministic_and_gpt2_style():
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, d_model=32)
    a, b = init_params(cfg, seed=5), init_params(cfg, seed=5)
    np.testing.assert_array_equal(a.flat, b.flat)
    assert not np.array_equal(a.flat, init_params(cfg, seed=6).flat)
    a64 = init_params(cfg, seed=5, dtype=np.float64)
    assert a64.flat.dtype == np.float64
    np.testing.assert_allclose(a64.flat, a.flat, rtol=1e-6, atol=1e-9)   # same values up to rounding
    for name in ("ln1w", "ln2w", "lnfw"):
        assert np.all(a[name] == 1.0)
    for name in ("ln1b", "ln2b", "qkvb", "attprojb", "fcb", "fcprojb", "lnfb"):
        assert np.all(a[name] == 0.0)
    assert a["wte"].std() == pytest.approx(0.02, rel=0.1)
    assert a["qkvw"].std() == pytest.approx(0.02, rel=0.1)
    assert a["wpe"].std() == pytest.approx(0.01, rel=0.1)
    assert a["fcprojw"].std() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.1)
    assert a["attprojw"].std() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.1)


def test_preset_config_is_the_preset_model_and_its_batch():
    from gpullm_lessons.model.params import PRESETS, preset_config

    cfg, B = preset_config("gpt2")
    assert B == PRESETS["gpt2"]["batch_size"] and cfg.d_model == 768 and cfg.vocab_size == 50304
    with pytest.raises(ValueError, match="unknown preset 'gpt3'"):
        preset_config("gpt3")
