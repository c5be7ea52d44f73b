"""DeepSpeed-Ulysses on real ranks: `python -m gpullm_lessons.parallel ulysses` started by the launcher on 2 and 4 MPI
ranks (CPU, the NumPy GPT), against the one-rank training job's losses, with the all-to-alls' elements as modelled,
each rank's activations 1/N of one rank's, and the replicas equal. One process: tests/test_ulysses.py."""

import json

import numpy as np
import pytest

from gpullm_lessons.model.params import GPTConfig
from gpullm_lessons.parallel import ulysses as U
from gpullm_lessons.parallel.launching import launch_subprocess

from test_comm import require_mpi
from test_pipeline_ranks import MODEL, one_rank_losses

MODEL = [*MODEL, "--n-head", "4"]  # 4 heads (the last flag wins): 1, 2 or 4 ranks
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, d_model=32)
ATOL = 1e-5  # positions' partial sums of each gradient added in MPI's order (parallel/ulysses.py, "Numerics")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return one_rank_losses(tmp_path_factory.mktemp("ulysses") / "one", MODEL)


@pytest.mark.parametrize("nproc", [2, 4])
def test_ranks_give_the_one_rank_losses_and_a_1_over_N_share_of_the_activations(one_rank, tmp_path, nproc):
    require_mpi()
    out, out1 = tmp_path / "u.json", tmp_path / "u1.json"
    p = launch_subprocess(nproc, ["ulysses", *MODEL, "--json", out], comm="mpi", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    np.testing.assert_allclose(res["losses"], one_rank, rtol=0, atol=ATOL)
    traffic = U.ulysses_traffic(CFG, nproc, 8, 16)
    assert res["traffic"] == traffic and res["replicas_equal"] is True
    assert res["traffic_measured"] == {k: traffic[k] for k in ("all_to_all", "all_to_alls", "sent")}
    single = U.main(
        [*MODEL, "--steps", "1", "--json", str(out1)],
        comm=__import__("gpullm_lessons.parallel.comm", fromlist=["SingleComm"]).SingleComm(),
    )
    assert all(b * nproc == single["cache_bytes"][0][0] for b in res["cache_bytes"][0])


def test_a_sequence_the_ranks_cannot_split_is_refused_on_every_rank():
    require_mpi()
    p = launch_subprocess(2, ["ulysses", *MODEL, "--block-size", "15", "--steps", "1"], comm="mpi", timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = {line for line in p.stderr.splitlines() if line.startswith("error: ")}
    assert lines == {
        "error: --block-size 15 does not split over 2 ranks: each rank takes T / N positions; pass a multiple of 2"
    }, p.stderr[-3000:]
