"""ZeRO-3 on real ranks: `python -m gpullm_lessons.parallel zero3` started by the launcher on 2 and 4 MPI ranks (CPU,
the NumPy GPT), against the one-rank training job's losses, with every rank's measured peak bytes equal to the
memory model. One process: tests/test_zero3.py."""

import json

import numpy as np
import pytest

from gpullm_lessons.model.params import GPTConfig
from gpullm_lessons.parallel import zero3 as Z
from gpullm_lessons.parallel.launching import launch_subprocess

from test_comm import require_mpi
from test_pipeline_ranks import MODEL, one_rank  # noqa: F401 - the one-rank job's losses (a module fixture)

# as data parallel: each rank's mean over B/N rows, the reduce_scatter's sum in MPI's order, then x 1/N, and the loss
# as the mean of the N local means: rounding of about 1e-7 relative, carried by AdamW (parallel/zero3.py, "Numerics")
ATOL = 1e-5


@pytest.mark.parametrize("nproc", [2, 4])
def test_ranks_give_the_one_rank_losses_and_the_modelled_memory(one_rank, tmp_path, nproc):  # noqa: F811
    require_mpi()
    out = tmp_path / "z3.json"
    p = launch_subprocess(nproc, ["zero3", *MODEL, "--json", out], comm="mpi", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    np.testing.assert_allclose(res["losses"], one_rank, rtol=0, atol=ATOL)
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, d_model=32)
    model = Z.zero3_memory(cfg, nproc)
    assert res["memory_model"] == model and res["world"] == nproc
    assert res["peak_bytes"] == [[model["peak"]] * nproc] * 3  # every rank, every step
    traffic = Z.zero3_traffic(cfg, nproc)
    assert res["traffic_measured"] == {"all_gather": traffic["all_gather"], "reduce_scatter": traffic["reduce_scatter"]}
    assert "peak bytes per rank" in p.stdout
    print(f"{nproc} ranks: |loss - one rank| max {np.abs(np.array(res['losses']) - one_rank).max():.1e}")


def test_a_batch_the_ranks_cannot_split_is_refused_on_every_rank():
    require_mpi()
    p = launch_subprocess(2, ["zero3", *MODEL[:-4], "--batch-size", "7", "--steps", "1"], comm="mpi", timeout=120)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and len(set(lines)) == 1, p.stderr[-3000:]
    assert "--batch-size 7 does not split over 2 ranks" in lines[0]
