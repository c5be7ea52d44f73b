"""Pipeline parallelism on real ranks: `python -m gpullm_lessons.parallel pipeline` started by the launcher on 2 and 4
MPI ranks (CPU, the NumPy GPT; one stage per rank), GPipe and 1F1B, against the one-rank training job's losses.
The schedules and the step in one process are tests/test_pipeline.py."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpullm_lessons.parallel import pipeline as PP
from gpullm_lessons.parallel.launching import launch_subprocess

from test_comm import ROOT, require_mpi

MODEL = [
    "--n-layer",
    "4",
    "--n-head",
    "2",
    "--d-model",
    "32",
    "--block-size",
    "16",
    "--batch-size",
    "8",
    "--steps",
    "3",
]
# the losses equal the one-rank job's to rounding (parallel/pipeline.py, "Numerics"): measured about 5e-7 here
ATOL = 1e-5


def one_rank_losses(out, model=MODEL):
    """The training job on one process, the NumPy engine, the whole batch (model: its flags), in `out`: its losses."""
    flags = ["--backend", "numpy", *model, "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0"]
    p = subprocess.run(
        [sys.executable, "-m", "gpullm_lessons.train", *flags, "--no-progress", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return np.array([json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The training job on one process, the NumPy engine, the whole batch: its losses."""
    return one_rank_losses(tmp_path_factory.mktemp("pipeline") / "one")


@pytest.mark.parametrize("nproc, schedule", [(2, "gpipe"), (2, "1f1b"), (4, "gpipe"), (4, "1f1b")])
def test_ranks_give_the_one_rank_losses(one_rank, tmp_path, nproc, schedule):
    require_mpi()
    m = 4
    out = tmp_path / "pp.json"
    args = ["pipeline", *MODEL, "--schedule", schedule, "--micro-batches", m, "--json", out]
    p = launch_subprocess(nproc, args, comm="mpi", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    np.testing.assert_allclose(res["losses"], one_rank, rtol=0, atol=ATOL)
    table = PP.make_schedule(schedule, nproc, m)
    assert res["stages"] == nproc and res["bubble"] == (nproc - 1) / (m + nproc - 1)
    assert res["peak_activations"] == res["peak_activations_table"] == PP.peak_activations(table)
    assert res["tied_equal"] is True
    assert all(0.0 <= b <= 1.0 for b in res["bubble_measured"])
    assert PP.format_schedule(table) in p.stdout and "measured bubble" in p.stdout
    print(f"{nproc} ranks {schedule}: |loss - one rank| max {np.abs(np.array(res['losses']) - one_rank).max():.1e}")


def test_more_ranks_than_blocks_is_refused_on_every_rank():
    require_mpi()
    p = launch_subprocess(2, ["pipeline", *MODEL[2:], "--n-layer", "1"], comm="mpi", timeout=120)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and len(set(lines)) == 1, p.stderr[-3000:]
    assert "2 ranks (one stage each) but the model has 1 block (--n-layer)" in lines[0]
