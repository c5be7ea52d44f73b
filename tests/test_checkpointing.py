"""Activation checkpointing: bitwise-equal gradients for every policy, measured vs predicted activation memory."""
import numpy as np
import pytest

from gpullm_lessons.model.checkpointing import (POLICIES, cache_bytes, gpt_backward_ckpt, gpt_forward_ckpt,
                                          memory_model)
from gpullm_lessons.model import checkpointing as ck
from gpullm_lessons.model.params import GPTConfig, init_params, num_params
from gpullm_lessons.reference.gpt import gpt_backward, gpt_forward

TINY = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, d_model=8)
CONFIGS = [TINY,
           GPTConfig(vocab_size=11, block_size=6, n_layer=3, n_head=4, d_model=16),
           GPTConfig(vocab_size=29, block_size=12, n_layer=1, n_head=1, d_model=12)]


def _batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B, T", [(2, 5), (1, 1)])
@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_bitwise_equal_reference(policy, B, T, dtype):
    params = init_params(TINY, seed=3, dtype=dtype)
    idx, targets = _batch(TINY, B, T)
    logits_ref, loss_ref, cache_ref = gpt_forward(params, TINY, idx, targets)
    grads_ref = params.zeros_like()
    gpt_backward(cache_ref, grads_ref)

    logits, loss, cache = gpt_forward_ckpt(params, TINY, idx, targets, policy=policy)
    grads = params.zeros_like()
    grads.flat[...] = 7.0                                   # overwritten, not accumulated
    gpt_backward_ckpt(cache, grads)
    assert loss.dtype == dtype and loss == loss_ref
    assert np.array_equal(logits, logits_ref)
    for name in grads.names:
        assert np.array_equal(grads[name], grads_ref[name]), f"{policy}: d{name} differs from the reference"



def test_one_gpt_backward():
    """checkpointing and precision run the reference gpt_forward / gpt_backward (keep=, recompute=, dloss=), not
    copies of their own: no GPT-level op (the loss, the head, the embedding) is called outside reference/gpt.py."""
    import inspect

    from gpullm_lessons.model import precision
    for module in (ck, precision):
        src = inspect.getsource(module)
        for op in ("crossentropy_backward", "encoder_backward", "encoder_forward", "block_backward("):
            assert op not in src, f"{module.__name__} calls {op}: use reference gpt_forward / gpt_backward"

@pytest.mark.parametrize("cfg", CONFIGS)
def test_full_less_than_selective_less_than_none(cfg):
    params = init_params(cfg, seed=0)
    idx, targets = _batch(cfg, 2, cfg.block_size // 2)
    sizes = {policy: cache_bytes(gpt_forward_ckpt(params, cfg, idx, targets, policy=policy)[2])
             for policy in POLICIES}
    assert sizes["full"] < sizes["selective"] < sizes["none"]


def test_cache_bytes_skips_parameters_and_counts_shared_arrays_once():
    params = init_params(TINY, seed=0)
    idx, targets = _batch(TINY, 2, 5)
    _, _, cache_ref = gpt_forward(params, TINY, idx, targets)
    _, _, cache = gpt_forward_ckpt(params, TINY, idx, targets, policy="none")
    assert cache_bytes(cache) == cache_bytes(cache_ref, params)   # params from the cache or passed
    assert cache_bytes(cache_ref) > cache_bytes(cache_ref, params)  # without them the weight views count
    as_dict = {name: params[name].copy() for name in params.names}     # params as a plain dict works too
    _, _, cache_dict = gpt_forward_ckpt(as_dict, TINY, idx, targets, policy="full")
    assert cache_bytes(cache_dict) == cache_bytes(gpt_forward_ckpt(params, TINY, idx, targets, policy="full")[2])
    a = np.zeros(10, dtype=np.float32)
    assert cache_bytes({"x": a, "y": [a, {"z": a}], "n": 3}) == 40


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("B, T", [(2, 5), (1, 1), (3, 6)])
@pytest.mark.parametrize("policy", POLICIES)
def test_memory_model_matches_measured_activations(policy, B, T, cfg):
    params = init_params(cfg, seed=0, dtype=np.float32)
    idx, targets = _batch(cfg, B, T)
    _, _, cache = gpt_forward_ckpt(params, cfg, idx, targets, policy=policy)
    measured = cache_bytes(cache)
    predicted = memory_model(cfg, B, T, precision="fp32", policy=policy)["activations"]
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


def test_memory_model_terms():
    cfg, B, T = CONFIGS[1], 2, 6
    P = num_params(cfg)
    fp32 = memory_model(cfg, B, T, "fp32", "none")
    bf16 = memory_model(cfg, B, T, "bf16", "none")
    assert (fp32["params"], fp32["params_half"], fp32["grads"], fp32["adamw"]) == (4 * P, 0, 4 * P, 8 * P)
    assert bf16["params_half"] == 2 * P and bf16["params"] == 4 * P
    assert bf16["activations"] < fp32["activations"]
    assert fp32["recompute_peak"] == 0
    full = memory_model(cfg, B, T, "fp32", "full")
    sel = memory_model(cfg, B, T, "fp32", "selective")
    # full recomputes one block: what "none" keeps per block, minus the kept block input x (B, T, C)
    assert full["recompute_peak"] == fp32["activations_per_block"] - B * T * cfg.d_model * 4
    assert sel["recompute_peak"] == B * T * (cfg.d_model + cfg.d_model + 4 * cfg.d_model) * 4
    for m in (fp32, bf16, full, sel):
        assert m["total"] == (m["params"] + m["params_half"] + m["grads"] + m["adamw"]
                              + m["activations"] + m["recompute_peak"])
    assert [name for name, _ in full["kept_per_block"]] == ["x: block input, ln1 inp (residual stream)"]


def test_bad_policy_and_precision():
    params = init_params(TINY, seed=0)
    idx, targets = _batch(TINY, 1, 3)
    with pytest.raises(ValueError, match=r"'none', 'selective', 'full', 'sqrt' \(or 'sqrt:K'.*\); got 'some'"):
        gpt_forward_ckpt(params, TINY, idx, targets, policy="some")
    with pytest.raises(ValueError, match=r"'none', 'selective', 'full'"):
        memory_model(TINY, 1, 3, policy="half")
    with pytest.raises(ValueError, match=r"'fp32', 'fp16', 'bf16'"):
        memory_model(TINY, 1, 3, precision="int8")
    with pytest.raises(ValueError, match=r"'none', 'selective', 'full'"):
        gpt_backward_ckpt({"policy": "sometimes"}, params.zeros_like())


def test_backward_without_targets_raises():
    params = init_params(TINY, seed=0)
    idx, _ = _batch(TINY, 1, 3)
    for policy in ("selective", "full"):
        logits, loss, cache = gpt_forward_ckpt(params, TINY, idx, None, policy=policy)
        assert loss is None and logits.shape == (1, 3, TINY.vocab_size)
        with pytest.raises(ValueError, match="no loss"):
            gpt_backward_ckpt(cache, params.zeros_like())


def test_tradeoff_points_take_memory_from_eager_runs_and_time_from_graph_runs():
    def row(policy, graphs, act, ms, preset="course"):
        return {"preset": preset, "precision": "bf16", "policy": policy, "graphs": graphs,
                "activation_bytes_measured": act, "step_ms": ms}
    rows = [row("none", "off", 100, 30.0), row("none", "on", 999, 10.0),
            row("full", "off", 25, 20.0), row("full", "on", 999, 13.0),
            row("none", "off", 10, 5.0, preset="cpu"), row("selective", "off", 8, 6.0, preset="cpu")]
    pts = ck.tradeoff_points(rows)
    assert pts["course bf16"]["full"] == pytest.approx((0.25, 1.3))       # eager memory, graph time
    assert pts["cpu bf16"]["selective"] == pytest.approx((0.8, 1.2))      # no graph runs: eager time
    assert ck.tradeoff_points([row("full", "off", 1, 1.0)]) == {}        # no "none" to compare with
