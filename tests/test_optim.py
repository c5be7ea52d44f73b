"""AdamW (PyTorch semantics), the learning-rate schedule and gradient clipping."""
import math

import numpy as np
import pytest

from gpullm_lessons.model.optim import DECAY_NAMES, AdamW, clip_grad_norm, decay_mask_for, lr_schedule


def test_adamw_two_steps_by_hand():
    # p = [1, -2, 0.5], lr 0.1, betas (0.9, 0.999), eps 1e-8, weight decay 0.1 on the first two elements only.
    p = np.array([1.0, -2.0, 0.5])
    opt = AdamW(p, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decay_mask=[True, True, False])

    # step 1, g = [0.1, -0.2, 0.3]
    #   decay:  p = p - 0.1*0.1*p = 0.99 p where masked        -> [0.99, -1.98, 0.5]
    #   m = 0.1 g = [0.01, -0.02, 0.03];  v = 0.001 g^2 = [1e-5, 4e-5, 9e-5]
    #   mhat = m / (1 - 0.9) = g;  vhat = v / (1 - 0.999) = g^2;  sqrt(vhat) = |g| = [0.1, 0.2, 0.3]
    #   p -= 0.1 * g / (|g| + 1e-8):  0.99 - 0.1*0.1/0.10000001 = 0.99 - 0.0999999900000010 = 0.890000009999999
    #                               -1.98 + 0.1*0.2/0.20000001 = -1.98 + 0.0999999950000002 = -1.8800000049999998
    #                                 0.5 - 0.1*0.3/0.30000001 = 0.5 - 0.0999999966666668 = 0.4000000033333332
    opt.step(np.array([0.1, -0.2, 0.3]))
    np.testing.assert_allclose(opt.m, [0.01, -0.02, 0.03], rtol=1e-12)
    np.testing.assert_allclose(opt.v, [1e-5, 4e-5, 9e-5], rtol=1e-12)
    np.testing.assert_allclose(p, [0.890000009999999, -1.8800000049999998, 0.4000000033333332], rtol=1e-13)

    # step 2, g = [0.2, 0.1, -0.3]
    #   decay:  0.99 * [0.890000009999999, -1.8800000049999998] = [0.881100009899999, -1.8612000049499998]
    #   m = 0.9 m + 0.1 g = [0.009 + 0.02, -0.018 + 0.01, 0.027 - 0.03] = [0.029, -0.008, -0.003]
    #   v = 0.999 v + 0.001 g^2 = [0.999e-5 + 4e-5, 3.996e-5 + 1e-5, 8.991e-5 + 9e-5] = [4.999e-5, 4.996e-5, 17.991e-5]
    #   mhat = m / (1 - 0.9^2 = 0.19) = [0.15263157894736842, -0.042105263157894736, -0.015789473684210527]
    #   vhat = v / (1 - 0.999^2 = 0.001999) = [0.025007503751875938, 0.024992496248124062, 0.09]
    #   sqrt(vhat) = [0.15813761017504956, 0.15809015228066567, 0.3]
    #   p -= 0.1 * mhat / (sqrt(vhat) + 1e-8):
    #     0.881100009899999  - 0.1*0.15263157894736842/0.15813762017504956 = 0.7845818134212524
    #    -1.8612000049499998 + 0.1*0.042105263157894736/0.15809016228066567 = -1.8345663026686756
    #     0.4000000033333332 + 0.1*0.015789473684210527/0.30000001           = 0.4052631610526315
    opt.step(np.array([0.2, 0.1, -0.3]))
    assert opt.t == 2
    np.testing.assert_allclose(opt.m, [0.029, -0.008, -0.003], rtol=1e-12)
    np.testing.assert_allclose(opt.v, [4.999e-5, 4.996e-5, 17.991e-5], rtol=1e-12)
    np.testing.assert_allclose(p, [0.7845818134212524, -1.8345663026686756, 0.4052631610526315], rtol=1e-13)


def _torch_arrangement(p, grads, lr, betas, eps, wd, mask):
    """PyTorch's _single_tensor_adamw written out as it computes (p *= 1 - lr wd; step_size = lr / bc1;
    denom = sqrt(v) / sqrt(bc2) + eps), a different arrangement of the same algorithm, in float64."""
    p = p.astype(np.float64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        p = np.where(mask, p * (1 - lr * wd), p)
        m = m + (g - m) * (1 - b1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
        v = v * b2 + (1 - b2) * g * g
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        denom = np.sqrt(v) / math.sqrt(bc2) + eps
        p = p - (lr / bc1) * m / denom
    return p


def test_adamw_matches_torch_arrangement_20_steps():
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(50)
    grads = [rng.standard_normal(50) * 0.1 for _ in range(20)]
    mask = rng.random(50) < 0.5
    p = p0.copy()
    opt = AdamW(p, lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay_mask=mask)
    for g in grads:
        opt.step(g)
    expected = _torch_arrangement(p0, grads, 3e-2, (0.9, 0.95), 1e-8, 0.1, mask)
    np.testing.assert_allclose(p, expected, rtol=1e-12, atol=1e-14)


TORCH_ADAMW = r"""
import json, sys
import numpy as np
import torch
d = json.load(sys.stdin)
p0, mask = np.array(d["p0"], np.float32), np.array(d["mask"])
wd_part = torch.nn.Parameter(torch.tensor(p0[mask]))
no_wd_part = torch.nn.Parameter(torch.tensor(p0[~mask]))
opt = torch.optim.AdamW([{"params": [wd_part], "weight_decay": 0.1}, {"params": [no_wd_part], "weight_decay": 0.0}],
                        lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
for g, lr in zip(d["grads"], d["lrs"]):
    g = np.array(g, np.float32)
    for group in opt.param_groups:
        group["lr"] = lr
    wd_part.grad, no_wd_part.grad = torch.tensor(g[mask]), torch.tensor(g[~mask])
    opt.step()
out = np.empty_like(p0)
out[mask], out[~mask] = wd_part.detach().numpy(), no_wd_part.detach().numpy()
print(json.dumps(out.tolist()))
"""


def test_adamw_matches_torch_20_steps():
    """20 steps against torch.optim.AdamW itself. torch runs in a subprocess: importing it inside a long pytest
    process that already loaded numba-cuda and the notebook machinery failed once on the GPU image."""
    import importlib.util
    import json
    import subprocess
    import sys
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: compare with torch.optim.AdamW skipped")
    rng = np.random.default_rng(1)
    n = 40
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * 0.1).astype(np.float32) for _ in range(20)]
    mask = np.arange(n) < n // 2  # first half decays
    lrs = [1e-2 * (1 + 0.1 * i) for i in range(20)]  # a changing lr, as a schedule does
    p = p0.copy()
    opt = AdamW(p, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay_mask=mask)
    for g, lr in zip(grads, lrs):
        opt.step(g, lr=lr)
    payload = json.dumps({"p0": p0.tolist(), "mask": mask.tolist(), "grads": [g.tolist() for g in grads], "lrs": lrs})
    proc = subprocess.run([sys.executable, "-c", TORCH_ADAMW], input=payload, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = np.array(json.loads(proc.stdout.strip().splitlines()[-1]), np.float32)
    np.testing.assert_allclose(p, expected, rtol=1e-5, atol=1e-6)


def test_adamw_in_place_float32_and_lr_override():
    p = np.ones(4, np.float32)
    view = p[:2]  # named views into the flat buffer must see the update
    opt = AdamW(p, lr=0.5, weight_decay=0.0)
    opt.step(np.array([1, -1, 0, 2], np.float32), lr=0.01)
    assert p.dtype == np.float32 and opt.m.dtype == np.float32
    np.testing.assert_allclose(view, [0.99, 1.01], rtol=1e-6)
    assert p[2] == 1.0  # zero gradient, no decay: unchanged


def test_adamw_state_dict_roundtrip():
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(6) for _ in range(6)]
    a_p = rng.standard_normal(6)
    a = AdamW(a_p, lr=0.01, weight_decay=0.1)
    for g in grads[:3]:
        a.step(g)
    b_p = a_p.copy()
    b = AdamW(b_p, lr=0.5)
    b.load_state_dict(a.state_dict())
    for g in grads[3:]:
        a.step(g)
        b.step(g)
    np.testing.assert_array_equal(a_p, b_p)
    assert b.t == 6


def test_adamw_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="flat"):
        AdamW(np.zeros((2, 2)))
    opt = AdamW(np.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        opt.step(np.zeros(4))
    with pytest.raises(ValueError, match="decay_mask"):
        AdamW(np.zeros(3), decay_mask=np.ones(2, bool))


def test_decay_mask_follows_nanogpt_rule():
    params = pytest.importorskip("gpullm_lessons.model.params", reason="model/params.py not written yet")
    cfg = params.GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, d_model=8)
    mask = decay_mask_for(cfg)
    assert mask.dtype == bool and mask.shape == (params.num_params(cfg),)
    offset = 0
    for name, shape in params.param_shapes(cfg).items():
        size = math.prod(shape)
        per_layer_dims = len(shape) - (1 if name not in ("wte", "wpe", "lnfw", "lnfb") else 0)
        assert (name in DECAY_NAMES) == (per_layer_dims >= 2), name
        assert mask[offset:offset + size].all() if name in DECAY_NAMES else not mask[offset:offset + size].any()
        offset += size
    assert set(DECAY_NAMES) == {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}


def test_lr_schedule_endpoints():
    max_lr, min_lr, warmup, total = 1e-3, 1e-4, 10, 110
    assert lr_schedule(0, max_lr, warmup, total, min_lr) == pytest.approx(1e-4)  # (0+1)/10 of max
    assert lr_schedule(4, max_lr, warmup, total, min_lr) == pytest.approx(5e-4)
    assert lr_schedule(9, max_lr, warmup, total, min_lr) == pytest.approx(max_lr)  # warmup ends at max
    assert lr_schedule(10, max_lr, warmup, total, min_lr) == pytest.approx(max_lr)  # cosine starts at max
    mid = warmup + (total - 1 - warmup) / 2
    assert lr_schedule(mid, max_lr, warmup, total, min_lr) == pytest.approx((max_lr + min_lr) / 2)
    assert lr_schedule(total - 1, max_lr, warmup, total, min_lr) == pytest.approx(min_lr)  # last step
    assert lr_schedule(total + 50, max_lr, warmup, total, min_lr) == pytest.approx(min_lr)
    assert lr_schedule(0, max_lr, 0, total, min_lr) == pytest.approx(max_lr)  # no warmup
    lrs = [lr_schedule(s, max_lr, warmup, total, min_lr) for s in range(total)]
    assert all(a <= b for a, b in zip(lrs[:warmup], lrs[1:warmup]))
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))


def test_clip_grad_norm():
    g = np.array([3.0, 4.0], np.float32)  # norm 5
    assert clip_grad_norm(g, 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(g, [0.6, 0.8], rtol=1e-5)
    assert g.dtype == np.float32
    g = np.array([0.3, 0.4])  # norm 0.5 < 1: unchanged
    assert clip_grad_norm(g, 1.0) == pytest.approx(0.5)
    np.testing.assert_array_equal(g, [0.3, 0.4])
    g = np.array([1e20, 1e20], np.float32)  # squares overflow float32; the norm is computed in float64
    assert clip_grad_norm(g, 1.0) == pytest.approx(math.sqrt(2) * 1e20)
    np.testing.assert_allclose(g, [1 / math.sqrt(2)] * 2, rtol=1e-5)


# ---- one update policy: the engine's update() over the whole buffer and over shards --------------------------------

def test_clip_coefficient():
    from gpullm_lessons.model.optim import clip_coefficient

    assert clip_coefficient(10.0, 1.0) == pytest.approx(1.0 / (10.0 + 1e-6))
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(10.0, 0.0) == 1.0 and clip_coefficient(10.0, -1) == 1.0


def test_the_update_over_two_shards_equals_the_update_over_the_buffer():
    """ZeRO's step is the engine's own update() on each shard, given the global squared norm: two shards of one
    engine end exactly where the whole-buffer update does (the NumPy engine: the same float32 arithmetic)."""
    from gpullm_lessons import engine
    from gpullm_lessons.model.params import GPTConfig, num_params

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 32, (4, 8)), rng.integers(0, 32, (4, 8))
    whole, halves = engine.build(cfg, "numpy", seed=1), engine.build(cfg, "numpy", seed=1)
    for eng in (whole, halves):
        eng.forward(x, y)
        eng.backward()
    n = num_params(cfg)
    S = (n + 1) // 2 + 7                                   # the second shard runs into padding
    ppad, gpad = halves.params.pad_to(2 * S), halves.grads.pad_to(2 * S)
    shards = [halves.optimizer_shard(lo, lo + S, ppad[lo:lo + S], gpad[lo:lo + S]) for lo in (0, S)]
    halves.release_optimizer_state()
    out_whole = whole.optimizer_step(lr=1e-2, weight_decay=0.1, grad_clip=0.05)   # clipping active
    sumsq = sum(halves.grad_sumsq(s.grads) for s in shards)
    for s in shards:
        halves.t = 0                                       # one optimizer step, however many shards: each is step 1
        out = halves.update(1e-2, 0.1, 0.05, sumsq=sumsq, shard=s)
    assert out["grad_norm"] == pytest.approx(out_whole["grad_norm"], rel=1e-12)
    assert halves.t == whole.t == 1
    np.testing.assert_array_equal(halves.params.flat, whole.params.flat)
    np.testing.assert_array_equal(np.concatenate([s.m for s in shards])[:n], whole.m)
    assert not ppad[n:].any() and halves.m.size == 0
