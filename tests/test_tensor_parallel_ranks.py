"""Tensor parallelism on real ranks: `python -m gpullm_lessons.parallel tensor` started by the launcher on 2 and 4 MPI
ranks (CPU, the NumPy GPT), against the one-rank training job's losses, with every rank's bytes equal to the memory
model and the replicated parameters bitwise equal on every rank. One process: tests/test_tensor_parallel.py."""

import json

import numpy as np
import pytest

from gpullm_lessons.model.params import GPTConfig
from gpullm_lessons.parallel import tensor as TP
from gpullm_lessons.parallel.launching import launch_subprocess

from test_comm import require_mpi
from test_pipeline_ranks import MODEL, one_rank_losses

MODEL = [*MODEL, "--n-head", "4"]  # test_pipeline_ranks' model with 4 heads (the last flag wins): 1, 2 or 4 ranks
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, d_model=32)
# not bitwise: each g all-reduce sums the N ranks' partial products x_r @ W_r (the matmul's sum over the input channels
# cut into N pieces, added in MPI's order) and each f all-reduce the partial input gradients the same way: rounding
# of about 1e-7 relative in float32, carried through the blocks and by AdamW (parallel/tensor.py, "Numerics")
ATOL = 1e-5


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The training job on one process, the NumPy engine, the whole batch, this file's model: its losses."""
    return one_rank_losses(tmp_path_factory.mktemp("tensor") / "one", MODEL)


@pytest.mark.parametrize("nproc", [2, 4])
def test_ranks_give_the_one_rank_losses_and_the_modelled_memory(one_rank, tmp_path, nproc):
    require_mpi()
    out = tmp_path / "tp.json"
    p = launch_subprocess(nproc, ["tensor", *MODEL, "--json", out], comm="mpi", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    np.testing.assert_allclose(res["losses"], one_rank, rtol=0, atol=ATOL)
    model = TP.tp_memory(CFG, nproc)
    assert res["memory_model"] == model and res["world"] == nproc
    assert res["bytes"] == [[model["total"]] * nproc] * 3  # every rank, every step
    traffic = TP.tp_traffic(CFG, nproc, 8, 16)
    assert res["traffic"] == traffic
    assert res["traffic_measured"] == {"all_reduce": traffic["all_reduce"], "all_reduces": traffic["all_reduces"]}
    assert res["replicated_equal"] is True  # no gradient communication, yet the same replicated parameters
    assert "all-reduced" in p.stdout and "bytes per rank" in p.stdout
    print(f"{nproc} ranks: |loss - one rank| max {np.abs(np.array(res['losses']) - one_rank).max():.1e}")


def test_heads_the_ranks_cannot_split_are_refused_on_every_rank():
    require_mpi()
    args = ["tensor", *MODEL, "--n-head", "1", "--steps", "1"]
    p = launch_subprocess(2, args, comm="mpi", timeout=120)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and len(set(lines)) == 1, p.stderr[-3000:]
    assert "--n-head 1 does not split over 2 ranks" in lines[0]


@pytest.mark.parametrize("nproc", [2, 4])
def test_sequence_parallel_ranks_give_the_one_rank_losses_with_the_same_elements_moved(one_rank, tmp_path, nproc):
    require_mpi()
    out = tmp_path / "sp.json"
    p = launch_subprocess(nproc, ["tensor", *MODEL, "--sequence-parallel", "--json", out], comm="mpi", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    np.testing.assert_allclose(res["losses"], one_rank, rtol=0, atol=ATOL)
    t = TP.tp_traffic(CFG, nproc, 8, 16)
    m = res["traffic_measured"]
    # every all-reduce of B T C became an all-gather and a reduce-scatter of it, along T
    assert m["all_gather"] == m["reduce_scatter"] == t["all_reduce"] and m["collectives"] == 2 * t["all_reduces"]
    assert res["replicated_equal"] is True and res["sequence_parallel"] is True
    assert "sequence parallel: T=16 as" in p.stdout
