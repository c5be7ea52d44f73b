"""check_adamw_step: passes a correct step (the reference, and the Numba launcher), fails each common mistake with
the hint that names it, reports not attempted / error / skipped as checks/backward.py does."""
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.checks.optim import check_adamw_mixed, check_adamw_step

SEEDS = range(8)


def make_step(bias=True, coupled=False, eps_inside=False, decay_all=False, zero_grad=True, t_offset=0,
              skip_tail=0):
    """A NumPy AdamW step in float32 over the flat buffers, with one mistake switched on."""
    def step(p, g, m, v, lr, b1, b2, eps, wd, t, table):
        bounds, flags = table
        mask = np.repeat(np.asarray(flags) != 0, np.diff(bounds))
        if decay_all:
            mask[:] = True
        n = p.size - skip_tail
        p_, g_, m_, v_, mask = p[:n], g[:n].copy(), m[:n], v[:n], mask[:n]
        f = np.float32
        if coupled:
            g_ += f(wd) * p_ * mask
        else:
            p_ -= f(lr * wd) * p_ * mask
        m_[...] = f(b1) * m_ + f(1 - b1) * g_
        v_[...] = f(b2) * v_ + f(1 - b2) * g_ * g_
        tt = t + t_offset
        mhat = m_ / f(1 - b1 ** tt) if bias else m_
        vhat = v_ / f(1 - b2 ** tt) if bias else v_
        denom = np.sqrt(vhat + f(eps)) if eps_inside else np.sqrt(vhat) + f(eps)
        p_ -= f(lr) * mhat / denom
        if zero_grad:
            g[:n] = 0
    return step


@pytest.mark.parametrize("seed", SEEDS)
def test_correct_passes(seed):
    r = check_adamw_step(make_step(), seed=seed, quiet=True)
    assert r.status == "correct", r.message


def test_numba_launchers_pass():
    from gpullm_lessons.backends import numba as nbk
    for version in nbk.versions("adamw"):
        r = check_adamw_step(lambda *a: nbk.adamw_step(*a, version=version), arrays="numba", seed=1, quiet=True)
        assert r.status == "correct", (version, r.message)


@pytest.mark.parametrize("mistake, words", [
    (dict(bias=False), "bias corrections are missing"),
    (dict(coupled=True), "weight decay is coupled"),
    (dict(eps_inside=True), "eps is inside the square root"),
    (dict(zero_grad=False), "gradient was not zeroed"),
    (dict(decay_all=True), "applied to every tensor"),
    (dict(t_offset=1), "step + 1"),
    (dict(skip_tail=5), "never updated"),
])
@pytest.mark.parametrize("seed", SEEDS)
def test_mistake_fails_with_its_hint(mistake, words, seed):
    r = check_adamw_step(make_step(**mistake), seed=seed, quiet=True)
    assert r.status == "wrong", r.message
    assert words in r.hint, r.message


def test_not_attempted_and_error():
    def todo(*a):
        raise NotImplementedError
    assert check_adamw_step(todo, quiet=True).status == "not attempted"

    def boom(*a):
        raise ValueError("oops")
    r = check_adamw_step(boom, quiet=True)
    assert r.status == "error" and "oops" in r.message


def test_prints_one_verdict(capsys):
    check_adamw_step(make_step(), seed=0)
    out = capsys.readouterr().out
    assert out.startswith("adamw_step: correct")


@pytest.mark.skipif(device.has_gpu(), reason="the skip path is for machines without a GPU")
def test_cupy_without_gpu_is_skipped():
    r = check_adamw_step(make_step(), arrays="cupy", quiet=True)
    assert r.status == "skipped"


def test_rejects_a_kernel_and_half_dtypes():
    with pytest.raises(TypeError):
        check_adamw_step(np.zeros(3))
    with pytest.raises(ValueError):
        check_adamw_step(make_step(), dtype=np.float16)


@pytest.mark.skipif(not device.has_gpu(), reason="needs a GPU (CuPy + the HIP kernels)")
def test_hip_launchers_pass_on_gpu():
    from gpullm_lessons.backends import hip as hipk
    for version in hipk.versions("adamw"):
        for size in ("small", "large"):
            r = check_adamw_step(lambda *a: hipk.adamw_step(*a, version=version), arrays="cupy", size=size,
                                 seed=2, quiet=True)
            assert r.status == "correct", (version, size, r.message)


# ---- check_adamw_mixed (06.1): unscale + AdamW + bf16 copy -------------------------------------------------------

def make_mixed(unscale="once", copy="rne", copy_when="after", zero=True, stale=None, walk="ok", decay="table"):
    """A NumPy mixed-precision step in float32 with one mistake switched on (stale: keep the first call's 'step'
    or 'scale'; walk='if': the tensor index advanced at most once per element, restarting every 64 elements as a
    grid of 64 threads would)."""
    import ml_dtypes
    first = {}

    def step_fn(p, g, m, v, half, lr, b1, b2, eps, wd, t, S, table):
        first.setdefault("t", t)
        first.setdefault("S", S)
        t = first["t"] if stale == "step" else t
        S = first["S"] if stale == "scale" else S
        bounds, flags = (np.asarray(a) for a in table)
        mask = np.repeat(flags != 0, np.diff(bounds))
        if walk == "if":
            mask = mask.copy()
            for start in range(64):
                j = 0
                for i in range(start, p.size, 64):
                    if bounds[j + 1] <= i:
                        j += 1
                    mask[i] = flags[j] != 0
        if decay == "all":
            mask[:] = True
        f = np.float32
        before = p.copy()
        gg = g * {"once": f(1 / S), "none": f(1), "twice": f(1 / S / S), "mult": f(S)}[unscale]
        p -= f(lr * wd) * p * mask
        m[...] = f(b1) * m + f(1 - b1) * gg
        v[...] = f(b2) * v + f(1 - b2) * gg * gg
        p -= f(lr) * (m / f(1 - b1 ** t)) / (np.sqrt(v / f(1 - b2 ** t)) + f(eps))
        src = before if copy_when == "before" else p
        half[...] = src.astype(ml_dtypes.bfloat16).view(np.uint16) if copy == "rne" else \
            (src.view(np.uint32) >> 16).astype(np.uint16)
        if zero:
            g[...] = 0
    return step_fn


@pytest.mark.parametrize("seed", range(4))
def test_mixed_correct_passes(seed):
    r = check_adamw_mixed(make_mixed(), arrays="numpy", seed=seed, quiet=True)
    assert r.status == "correct", r.message
    assert "3 calls" in r.message and "bf16 copy bit-exact" in r.message


@pytest.mark.parametrize("mistake, words", [
    (dict(unscale="none"), "loss scale was not undone"),
    (dict(unscale="twice"), "undone twice"),
    (dict(unscale="mult"), "multiplied by the loss scale"),
    (dict(copy="trunc"), "copy is truncated"),
    (dict(copy_when="before"), "BEFORE the update"),
    (dict(zero=False), "not zeroed"),
    (dict(stale="step"), "bias corrections are those of your previous call"),
    (dict(stale="scale"), "previous call's loss scale"),
    (dict(walk="if"), "decay flag is wrong"),
    (dict(decay="all"), "applied to every tensor"),
])
@pytest.mark.parametrize("seed", range(3))
def test_mixed_mistake_fails_with_its_hint(mistake, words, seed):
    r = check_adamw_mixed(make_mixed(**mistake), arrays="numpy", seed=seed, quiet=True)
    assert r.status == "wrong", r.message
    assert words in r.hint, r.message


def test_mixed_large_size_runs_past_the_gpu_grid():
    r = check_adamw_mixed(make_mixed(), arrays="numpy", size="large", seed=0, quiet=True)
    assert r.status == "correct" and r.dims["calls"] == 4 and max(r.dims["n"]) > 4096 * 256, r.message


def test_mixed_reports_not_attempted_error_and_bad_arguments(capsys):
    def todo(*a):
        raise NotImplementedError
    assert check_adamw_mixed(todo, arrays="numpy", quiet=True).status == "not attempted"

    def boom(*a):
        raise IndexError("index 7 is out of bounds")
    r = check_adamw_mixed(boom, arrays="numpy", quiet=True)
    assert r.status == "error" and "IndexError" in r.message and "call 1 of" in r.hint
    with pytest.raises(TypeError, match="pass the function itself"):
        check_adamw_mixed(np.zeros(3))
    with pytest.raises(ValueError, match="size="):
        check_adamw_mixed(make_mixed(), arrays="numpy", size="huge")
    check_adamw_mixed(make_mixed(), arrays="numpy", seed=0)
    assert capsys.readouterr().out.startswith("adamw_mixed: correct")


def test_mixed_seed_repeats_and_labels_the_task():
    a = check_adamw_mixed(make_mixed(copy="trunc"), arrays="numpy", seed=11, task="06.1 t", quiet=True)
    b = check_adamw_mixed(make_mixed(copy="trunc"), arrays="numpy", seed=11, quiet=True)
    assert a.message == b.message and "seed 11" in a.message and a.task == "06.1 t"


@pytest.mark.skipif(device.has_gpu(), reason="the skip path is for machines without a GPU")
def test_mixed_cupy_without_gpu_is_skipped():
    assert check_adamw_mixed(make_mixed(), arrays="cupy", quiet=True).status == "skipped"
