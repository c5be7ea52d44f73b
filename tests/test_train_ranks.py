"""One training job for 1..N ranks: the same flags give the same errors, checkpoints, resume and log on one process
and on 2 MPI ranks (CPU, the NumPy engine); a 2-rank log has the 1-rank keys plus the communication time."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpullm_lessons.parallel import launch as L
from gpullm_lessons import train

from test_comm import ROOT, require_mpi

TINY = [
    "--backend",
    "numpy",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--d-model",
    "32",
    "--block-size",
    "16",
    "--batch-size",
    "8",
    "--eval-every",
    "0",
    "--eval-batches",
    "1",
    "--sample-tokens",
    "0",
    "--no-progress",
]

# a stand-in for a process killed during step 5 (the backward of the step after t = 4 optimizer steps), on every rank:
# `python crash_at_5.py <train flags>` is the training job with that one change
CRASH = textwrap.dedent("""
    import sys
    from gpullm_lessons import engine, train

    build = engine.build

    def crashing_build(*a, **k):
        eng = build(*a, **k)
        backward = eng.backward

        def crash_at_5(*a, **k):
            if eng.t == 4:
                raise SystemExit(17)
            return backward(*a, **k)

        eng.backward = crash_at_5
        return eng

    engine.build = crashing_build
    train.main(sys.argv[1:])
""")


def _env(extra_path=None):
    env = L.mpi_env()
    env["GPULLM_COMM"] = "mpi"  # CPU ranks, even on a machine with GPUs
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + ([str(extra_path)] if extra_path else []) + [env.get("PYTHONPATH", "")]
    )
    return env


def job(ranks, args, script=None, timeout=180):
    """The training job on `ranks` processes (1: plain python; 2: mpirun), or `script` with the same arguments."""
    if ranks > 1:
        require_mpi()
    cmd = [sys.executable, str(script)] if script else [sys.executable, "-m", "gpullm_lessons.train"]
    if ranks > 1:
        cmd = L.mpirun_command(ranks, [], module="gpullm_lessons.train")[:-3] + cmd  # mpirun -n N ... python
    return subprocess.run(
        cmd + [str(a) for a in args],
        env=_env(script.parent if script else None),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def losses(out):
    return np.array([r["loss"] for r in records(out)])


def test_mpirun_prefix_is_what_the_helper_assumes():
    require_mpi()
    cmd = L.mpirun_command(2, [], module="gpullm_lessons.train")
    assert cmd[-3:] == [sys.executable, "-m", "gpullm_lessons.train"]


# ---- bad input: the same named error, exit status 2 and no traceback, on one process and on 2 ranks ------------------


def _bad_cases(tmp):
    empty = tmp / "empty.txt"
    empty.write_bytes(b"")
    return {
        "empty data": ["--data", empty],
        "missing data": ["--data", tmp / "nope.txt"],
        "heads": ["--d-model", "65"],
        "graphs on the CPU": ["--graphs", "on"],
        "graphs with ZeRO": ["--zero", "--graphs", "on"],
        "overlap with ZeRO-2": ["--zero", "2", "--overlap", "--bucket-mb", "1"],
        "negative checkpoint interval": ["--checkpoint-every", "-1"],
        "resume without a checkpoint": ["--resume"],
    }


@pytest.mark.parametrize(
    "case",
    [
        "empty data",
        "missing data",
        "heads",
        "graphs on the CPU",
        "graphs with ZeRO",
        "overlap with ZeRO-2",
        "negative checkpoint interval",
        "resume without a checkpoint",
    ],
)
def test_bad_input_is_the_same_error_on_one_and_two_ranks(tmp_path, case):
    flags = TINY + _bad_cases(tmp_path)[case] + ["--steps", "2", "--out", tmp_path / "out"]
    lines = {}
    for ranks in (1, 2):
        p = job(ranks, flags)
        assert p.returncode != 0, f"{ranks} rank(s): {case} was accepted\n{p.stdout[-2000:]}"
        assert "Traceback" not in p.stderr, f"{ranks} rank(s): {case} ended in a traceback:\n{p.stderr[-3000:]}"
        lines[ranks] = {line for line in p.stderr.splitlines() if line.startswith("error: ")}
        assert lines[ranks], f"{ranks} rank(s): no 'error: ...' line for {case}:\n{p.stderr[-3000:]}"
    assert job(1, flags).returncode == 2
    assert lines[1] == lines[2], f"{case}: one rank says {lines[1]}, two ranks say {lines[2]}"
    assert not (tmp_path / "out" / "log.jsonl").exists()


def test_batch_must_divide_by_the_ranks(tmp_path):
    p = job(2, TINY + ["--batch-size", "3", "--steps", "1", "--out", tmp_path])
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "error: the global batch --batch-size 3 does not divide by the 2 ranks" in p.stderr


# ---- the same run, its log, its checkpoints and resume on 1 and 2 ranks --------------------------------------------

ARGS = TINY + ["--steps", "6", "--eval-every", "3", "--checkpoint-every", "3"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks") / "one"
    summary = train.main([str(a) for a in ARGS] + ["--out", str(out)])
    return out, summary


@pytest.mark.parametrize("zero", [0, 1, 2], ids=["data-parallel", "zero1", "zero2"])
def test_two_ranks_log_checkpoint_and_resume_like_one(one_rank, tmp_path, zero):
    one, _ = one_rank
    extra = {0: [], 1: ["--zero"], 2: ["--zero", "2"]}[zero]  # --zero alone: ZeRO-1
    straight = tmp_path / "straight"
    p = job(2, ARGS + extra + ["--out", straight])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # the log: every 1-rank key, plus the seconds of gradient communication (in flight; waited for: all of it here)
    a, b = records(one), records(straight)
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, 7))
    for ra, rb in zip(a, b):
        assert set(rb) == set(ra) | {"comm_s", "comm_exposed_s"} and rb["comm_s"] >= 0
        assert rb["comm_exposed_s"] == rb["comm_s"]
    np.testing.assert_allclose(losses(straight), losses(one), rtol=1e-5)
    np.testing.assert_allclose([r.get("val_loss", 0) for r in b], [r.get("val_loss", 0) for r in a], rtol=1e-5)
    assert "replicas identical" in p.stdout
    # the checkpoint holds the whole model's state on any rank count (ZeRO: the shards' m and v gathered)
    ca, cb = train.load_checkpoint(one / "ckpt.npz"), train.load_checkpoint(straight / "ckpt.npz")
    for key in ("params", "m", "v"):  # equal to fp32 rounding, which AdamW can blow up to ~lr on gradients near 0
        want = ca["engine"][key]
        assert cb["engine"][key].shape == want.shape
        np.testing.assert_allclose(cb["engine"][key], want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    assert cb["progress"]["step"] == 6 and cb["progress"]["sampler"] == ca["progress"]["sampler"]
    assert cb["config"]["world_size"] == 2 and cb["config"]["zero"] == zero

    # killed during step 5 on both ranks: --checkpoint-every 3 left step 3's checkpoint; --resume continues it
    crash = tmp_path / "crash_at_5.py"
    crash.write_text(CRASH)
    resumed = tmp_path / "resumed"
    p = job(2, ARGS + extra + ["--out", resumed], script=crash)
    assert p.returncode != 0
    assert [r["step"] for r in records(resumed)] == [1, 2, 3, 4]
    assert train.load_checkpoint(resumed / "ckpt.npz")["progress"]["step"] == 3
    p = job(2, ARGS + extra + ["--out", resumed, "--resume"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resume: from" in p.stdout and "at step 3" in p.stdout
    assert [r["step"] for r in records(resumed)] == list(range(1, 7))
    assert list(losses(resumed)) == list(losses(straight))  # exactly: the same ranks, the same run
    cr = train.load_checkpoint(resumed / "ckpt.npz")
    for key in ("params", "m", "v"):
        assert np.array_equal(cr["engine"][key], cb["engine"][key])


def test_a_one_rank_checkpoint_resumes_on_two_ranks(one_rank, tmp_path):
    one, _ = one_rank
    crash = tmp_path / "crash_at_5.py"
    crash.write_text(CRASH)
    out = tmp_path / "out"
    p = job(1, ARGS + ["--out", out], script=crash)
    assert p.returncode != 0 and train.load_checkpoint(out / "ckpt.npz")["progress"]["step"] == 3
    p = job(2, ARGS + ["--out", out, "--resume"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "world_size 1 != 2" in p.stdout  # reported as a change, not refused
    np.testing.assert_allclose(losses(out), losses(one), rtol=1e-5)
