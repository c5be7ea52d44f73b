"""check_adamw_step: passes a correct step (the reference, and the Numba launcher), fails each common mistake with
the hint that names it, reports not attempted / error / skipped as checks.py does."""
import numpy as np
import pytest

from gpullm_lessons import device
from gpullm_lessons.checks_optim import check_adamw_step

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
