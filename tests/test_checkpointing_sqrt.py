"""The sqrt(n) checkpointing schedule (policy "sqrt" / "sqrt:K"): gradients equal to policy "none" (bitwise in the
NumPy reference and engine, within the usual tolerance in the Numba engine in the simulator), a backward that holds
one segment of recomputed caches at a time (measured with weak references, against memory_model), the memory
models' peak against the segment length, and bad segment values refused by name everywhere they can be given."""

import math
import weakref

import numpy as np
import pytest

from gpullm_lessons.model import checkpointing as ck
from gpullm_lessons import engine, train
from gpullm_lessons.runtime.arrays import to_numpy
from gpullm_lessons.model.params import GPTConfig, init_params
from gpullm_lessons.reference import gpt as reference_gpt

FIVE = GPTConfig(vocab_size=13, block_size=8, n_layer=5, n_head=2, d_model=8)  # segments of 2: (0,2) (2,4) (4,5)
SEVEN = GPTConfig(vocab_size=11, block_size=6, n_layer=7, n_head=4, d_model=16)


def _batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


def _grads(params, cfg, idx, targets, policy):
    _, loss, cache = ck.gpt_forward_ckpt(params, cfg, idx, targets, policy=policy)
    grads = params.zeros_like()
    grads.flat[...] = 7.0  # overwritten, not accumulated
    ck.gpt_backward_ckpt(cache, grads)
    return loss, grads


# ---- the schedule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_layer", [1, 2, 5, 12, 48, 100])
def test_sqrt_means_segments_of_round_sqrt_L(n_layer):
    name, k = ck.parse_policy("sqrt", n_layer)
    assert name == "sqrt" and k == max(1, round(math.sqrt(n_layer)))
    assert ck.parse_policy(f"sqrt:{n_layer}", n_layer) == ("sqrt", n_layer)
    assert ck.parse_policy("full", n_layer) == ("full", None)


@pytest.mark.parametrize("n_layer", [1, 5, 7, 12])
def test_segments_cover_every_block_once_in_order(n_layer):
    for k in range(1, n_layer + 1):
        segs = ck.segments(n_layer, k)
        assert [l for a, b in segs for l in range(a, b)] == list(range(n_layer))
        assert all(b - a == k for a, b in segs[:-1]) and 1 <= segs[-1][1] - segs[-1][0] <= k
        assert len(segs) == math.ceil(n_layer / k)


BAD = [
    ("sqrt:0", r"the segment length K of 'sqrt:0' must be a whole number of blocks, 1 or more.*got '0'"),
    ("sqrt:-2", r"the segment length K of 'sqrt:-2' must be a whole number.*got '-2'"),
    ("sqrt:two", r"the segment length K of 'sqrt:two' must be a whole number.*got 'two'"),
    ("sqrt:2.5", r"the segment length K of 'sqrt:2.5' must be a whole number.*got '2.5'"),
    ("sqrt:", r"the segment length K of 'sqrt:' must be a whole number.*got ''"),
    (
        "sqrt:6",
        r"the segment length of 'sqrt:6' is 6 blocks but the model has only 5 \(n_layer\); choose K from 1 to 5",
    ),
    ("full:2", r"policy must be one of 'none', 'selective', 'full', 'sqrt' \(or 'sqrt:K'.*got 'full:2'"),
]


@pytest.mark.parametrize("policy, message", BAD)
def test_bad_segment_values_are_named_everywhere(policy, message, tmp_path):
    params = init_params(FIVE, seed=0)
    idx, targets = _batch(FIVE, 1, 3)
    with pytest.raises(ValueError, match="gpt_forward_ckpt: " + message):
        ck.gpt_forward_ckpt(params, FIVE, idx, targets, policy=policy)
    with pytest.raises(ValueError, match="memory_model: " + message):
        ck.memory_model(FIVE, 1, 3, policy=policy)
    with pytest.raises(ValueError, match="engine_memory: " + message):
        engine.engine_memory(FIVE, 1, 3, policy=policy)
    with pytest.raises(engine.EngineError, match=message):
        engine.build(FIVE, "numpy", policy=policy)
    flags = ["--backend", "numpy", "--n-layer", "5", "--out", str(tmp_path), "--checkpointing", policy]
    if policy in ("sqrt:6",):  # the spelling is right: the model's n_layer refuses it, before any training
        with pytest.raises(train.ConfigError, match="--checkpointing: " + message):
            train.main(flags)
        assert not (tmp_path / "log.jsonl").exists()
    else:  # the command line refuses the spelling itself
        with pytest.raises(SystemExit):
            train.main(flags)


def test_command_line_names_a_bad_segment_length(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--checkpointing", "sqrt:0"])
    assert e.value.code == 2
    assert (
        "argument --checkpointing: the segment length K of 'sqrt:0' must be a whole number" in capsys.readouterr().err
    )


# ---- gradients ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", [FIVE, SEVEN], ids=["L5", "L7"])
def test_every_segment_length_gives_the_gradients_of_none_bitwise(cfg, dtype):
    params = init_params(cfg, seed=3, dtype=dtype)
    idx, targets = _batch(cfg, 2, 5)
    loss_ref, g_ref = _grads(params, cfg, idx, targets, "none")
    for policy in ["sqrt"] + [f"sqrt:{k}" for k in range(1, cfg.n_layer + 1)]:
        loss, g = _grads(params, cfg, idx, targets, policy)
        assert loss == loss_ref
        for name in g.names:
            assert np.array_equal(g[name], g_ref[name]), f"{policy}: d{name} differs from policy 'none'"


def _unchained_recompute(p, cfg, layers, k):
    """A plausible wrong schedule: every block of a segment recomputed from the segment's saved input (the forward
    not chained through the segment), instead of from the block below's output."""
    segment_of = {l: (a, b) for a, b in ck.segments(cfg.n_layer, k) for l in range(a, b)}
    return lambda l, kept: ck.block_forward(p, l, layers[segment_of[l][0]], cfg.n_head)[1]


def test_a_segment_recomputed_from_the_wrong_input_is_caught(monkeypatch):
    """The bitwise comparison above can fail: with the unchained recompute every block but a segment's first gets
    the wrong input, and its gradients are far off."""
    params = init_params(FIVE, seed=3)
    idx, targets = _batch(FIVE, 2, 5)
    _, g_ref = _grads(params, FIVE, idx, targets, "none")
    monkeypatch.setattr(ck, "_segment_recompute", _unchained_recompute)
    _, g = _grads(params, FIVE, idx, targets, "sqrt:2")
    assert np.array_equal(g["qkvw"][4], g_ref["qkvw"][4])  # block 4 starts its own segment: right input
    assert not np.allclose(g["qkvw"][3], g_ref["qkvw"][3], rtol=1e-3, atol=0)  # block 3: fed block 2's input


def test_numpy_engine_sqrt_steps_equal_none():
    x, y = _batch(SEVEN, 2, 6, seed=4)
    a, b = engine.build(SEVEN, "numpy"), engine.build(SEVEN, "numpy", policy="sqrt:3")
    for _ in range(2):
        ra = a.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
        rb = b.train_step(x, y, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"]
        assert np.array_equal(a.grads.flat, b.grads.flat) and np.array_equal(a.params.flat, b.params.flat)


def test_numba_engine_sqrt_gradients_equal_none_and_the_reference():
    """The GPU engine's schedule (GPUEngine.backward) in the simulator: the same kernels recompute the segment, so
    the gradients equal its own policy "none" bitwise, and the NumPy reference within the usual tolerance."""
    cfg = GPTConfig(vocab_size=32, block_size=4, n_layer=3, n_head=2, d_model=8)  # sqrt:2 -> segments (0,2) (2,3)
    x, y = (a.astype(np.int32) for a in _batch(cfg, 1, 4, seed=2))

    def grads(eng):
        _, loss = eng.forward(x, y)
        eng.backward()
        return loss, {k: to_numpy(eng.grads[k]) for k in eng.grads.names}

    loss_ref, g_ref = grads(engine.build(cfg, "numpy"))
    _, g_none = grads(engine.build(cfg, "numba", policy="none"))
    loss, g = grads(engine.build(cfg, "numba", policy="sqrt:2"))
    assert all(np.array_equal(g[k], g_none[k]) for k in g)
    assert abs(loss - loss_ref) <= 1e-5 * loss_ref
    rel = max(float(np.abs(g[k] - g_ref[k]).max() / max(float(np.abs(g_ref[k]).max()), 1e-30)) for k in g)
    assert rel < 1e-4


# ---- memory: what backward holds, measured -----------------------------------------------------------------------
def _walk(obj):
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


def recomputed_bytes_alive(monkeypatch, params, cfg, idx, targets, policy):
    """The bytes of recomputed block caches still alive as each block's backward starts (one number per block, in
    backward order), measured: every array a recompute creates is watched through a weak reference, and just
    before each block_backward the live ones are counted (cache_bytes: weight views not counted, shared arrays once;
    the segment inputs the forward kept are counted in the activations, not here)."""
    watched = weakref.WeakValueDictionary()
    real_forward, real_backward = ck.block_forward, reference_gpt.block_backward
    alive, kept = [], []

    def watching_forward(p, l, x, n_head):  # the recompute's block forward (gpt_forward calls its own)
        out, c = real_forward(p, l, x, n_head)
        for a in _walk(c):
            watched[id(a)] = a
        return out, c

    def measuring_backward(dx, c, grads, l):
        live = [a for a in watched.values() if not any(a is s for s in kept)]
        alive.append(ck.cache_bytes(live, params))
        return real_backward(dx, c, grads, l)

    monkeypatch.setattr(ck, "block_forward", watching_forward)
    monkeypatch.setattr(reference_gpt, "block_backward", measuring_backward)
    _, _, cache = ck.gpt_forward_ckpt(params, cfg, idx, targets, policy=policy)
    kept.extend(a for a in cache["layers"] if a is not None)
    ck.gpt_backward_ckpt(cache, params.zeros_like())
    return alive


@pytest.mark.parametrize("policy", ["full", "sqrt", "sqrt:2", "sqrt:3", "sqrt:7"])
def test_backward_holds_one_segment_of_caches_as_memory_model_says(monkeypatch, policy):
    params = init_params(SEVEN, seed=0)
    idx, targets = _batch(SEVEN, 2, 5)
    alive = recomputed_bytes_alive(monkeypatch, params, SEVEN, idx, targets, policy)
    m = ck.memory_model(SEVEN, 2, 5, "fp32", policy)
    assert max(alive) == m["recompute_peak"]
    # and the forward kept what memory_model says: one input per segment
    _, _, cache = ck.gpt_forward_ckpt(params, SEVEN, idx, targets, policy=policy)
    assert ck.cache_bytes(cache) == m["activations"]
    assert sum(a is not None for a in cache["layers"]) == m["kept_blocks"]


def _hoarding_recompute(p, cfg, layers, k):
    """A plausible wrong schedule: the segment is recomputed right, but its caches are never dropped (a dict of
    every recomputed cache, read instead of popped)."""
    segment_of = {l: (a, b) for a, b in ck.segments(cfg.n_layer, k) for l in range(a, b)}
    held = {}

    def recompute(l, kept):
        if l not in held:
            a, b = segment_of[l]
            x = layers[a]
            for j in range(a, b):
                x, held[j] = ck.block_forward(p, j, x, cfg.n_head)
        return held[l]

    return recompute


def test_caches_that_are_never_dropped_are_caught(monkeypatch):
    """The measurement above can fail: the hoarding schedule gives the same gradients, but backward ends up holding
    every block's cache, far over memory_model's recompute_peak."""
    params = init_params(SEVEN, seed=0)
    idx, targets = _batch(SEVEN, 2, 5)
    monkeypatch.setattr(ck, "_segment_recompute", _hoarding_recompute)
    alive = recomputed_bytes_alive(monkeypatch, params, SEVEN, idx, targets, "sqrt:2")
    assert max(alive) > 2 * ck.memory_model(SEVEN, 2, 5, "fp32", "sqrt:2")["recompute_peak"]


def test_activation_timeline_of_sqrt_peaks_within_the_model():
    for k in range(1, SEVEN.n_layer + 1):
        points = ck.activation_timeline(SEVEN, 2, 5, policy=f"sqrt:{k}")
        m = ck.memory_model(SEVEN, 2, 5, "fp32", f"sqrt:{k}")
        assert max(b for _, b in points) <= m["activations"] + m["recompute_peak"]
        assert points[-1][1] == points[0][1]  # everything freed again but the token ids
    assert ck.activation_timeline(SEVEN, 2, 5, policy="sqrt:1") == ck.activation_timeline(SEVEN, 2, 5, policy="full")


# ---- memory: the peak against the segment length ------------------------------------------------------------------
def _peak(model, cfg, B, T, precision, k):
    """The activations' peak under sqrt:k: what the forward keeps + the most backward holds on top of it."""
    m = model(cfg, B, T, precision, f"sqrt:{k}")
    return m["activations"] + (m["recompute_peak"] if "recompute_peak" in m else m["working_set"])


@pytest.mark.parametrize("model", [ck.memory_model, engine.engine_memory], ids=["memory_model", "engine_memory"])
def test_peak_against_segment_length_is_lowest_near_sqrt_of_L_over_r(model):
    """Peak(k) = ceil(L / k) inputs + k block caches: with r = (one block's cache) / (one block input), lowest near
    k = sqrt(L / r), the classic sqrt(L) when r = 1. A deep, narrow model with short windows puts that well inside
    1..L; there the sqrt schedule beats both ends ("full", k = 1, and one segment, k = L)."""
    cfg, B, T = GPTConfig(vocab_size=64, block_size=16, n_layer=400, n_head=1, d_model=64), 4, 16
    peaks = {k: _peak(model, cfg, B, T, "fp32", k) for k in range(1, cfg.n_layer + 1)}
    best = min(peaks, key=peaks.get)
    x = B * T * cfg.d_model * 4  # one block input, fp32
    r = model(cfg, B, T, "fp32", "none")["activations_per_block"] / x  # policy "none" keeps a whole cache per block
    k_star = math.sqrt(cfg.n_layer / r)
    assert 2 < k_star < cfg.n_layer / 2  # the case this test is for
    assert math.floor(k_star) - 1 <= best <= math.ceil(k_star) + 1, (best, k_star, r)
    assert peaks[best] < 0.75 * min(peaks[1], peaks[cfg.n_layer])


def test_for_gpt2_sized_blocks_the_best_segment_is_short():
    """A GPT-2 block caches ~30 times its input at T = 1024 (the attention probabilities alone are nh * T / C = 16
    times it), so sqrt(L / r) < 2 even at 48 layers: segments of round(sqrt(L)) blocks hold more than "full"."""
    for n_layer in (12, 48):
        cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=n_layer, n_head=12, d_model=768)
        peaks = {k: _peak(ck.memory_model, cfg, 8, 1024, "bf16", k) for k in range(1, n_layer + 1)}
        assert min(peaks, key=peaks.get) <= 2
        k = ck.parse_policy("sqrt", n_layer)[1]
        assert peaks[k] > peaks[1]
