"""ZeRO++'s qwZ and qgZ on real ranks: `python -m gpullm_lessons.parallel zero3 --quantized` started by the launcher
on 2 and 4 MPI ranks (CPU, the NumPy GPT, 10 steps) against the fp32 ZeRO-3 command's losses within LOSS_GAP, with the
bytes per step counted equal to zeropp_traffic's and every rank's peak bytes ZeRO-3's model. One process:
tests/test_zeropp.py."""

import json

import numpy as np
import pytest

from gpullm_lessons.model.params import GPTConfig
from gpullm_lessons.parallel import zero3 as Z
from gpullm_lessons.parallel import zero3 as ZP
from gpullm_lessons.parallel.launching import launch_subprocess

from test_comm import require_mpi
from test_zeropp import MODEL

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, d_model=32)


def launch(nproc, out, *extra):
    p = launch_subprocess(nproc, ["zero3", *MODEL, *extra, "--json", out], comm="mpi", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


@pytest.mark.parametrize("nproc", [2, 4])
def test_quantised_ranks_follow_the_fp32_run_and_count_the_modelled_bytes(tmp_path, nproc):
    require_mpi()
    fp32, _ = launch(nproc, tmp_path / "fp32.json")
    res, out = launch(nproc, tmp_path / "q.json", "--quantized")
    gap = np.abs(np.array(res["losses"]) - fp32["losses"])
    assert 0 < gap.max() < ZP.LOSS_GAP  # measured 1.3e-2 on 2 ranks (parallel/zero3.py, ZeroPP, "Numerics")
    t = ZP.zeropp_traffic(CFG, nproc)
    assert res["traffic_bytes"] == t and res["world"] == nproc
    assert res["traffic_bytes_measured"] == {k: t[k] for k in ("all_gather_bytes", "reduce_scatter_bytes")}
    assert res["traffic_measured"] == fp32["traffic_measured"]  # the same collectives, in elements
    assert res["peak_bytes"] == [[Z.zero3_memory(CFG, nproc)["peak"]] * nproc] * 10
    assert f"| bytes {t['total_bytes']:,}" in out and t["ratio"] > 3.9
    print(
        f"{nproc} ranks: |loss(int8) - loss(fp32)| max {gap.max():.1e}; bytes {t['total_bytes']:,} vs fp32 "
        f"{t['zero3_total_bytes']:,}"
    )


@pytest.mark.parametrize("nproc,node", [(2, 2), (4, 2)])
def test_hpz_ranks_give_zeropp_losses_bitwise_and_the_modelled_copies_and_bytes(tmp_path, nproc, node):
    """hpZ's second gathers stay inside nodes of `node` ranks and read back the first gather's messages: the losses
    are ZeroPP's bit for bit; across nodes the gathers move each unit once (about half of ZeroPP's gather bytes)."""
    require_mpi()
    base, _ = launch(nproc, tmp_path / "q.json", "--quantized", "--steps", "3")
    res, out = launch(nproc, tmp_path / "h.json", "--quantized", "--steps", "3", "--hpz", str(node))
    assert res["losses"] == base["losses"]
    model = ZP.hpz_model(CFG, nproc, node)
    assert res["hpz_measured"] == model == res["hpz_model"]
    assert model["all_gather_bytes"] + model["node_gather_bytes"] == ZP.zeropp_traffic(CFG, nproc)["all_gather_bytes"]
    assert model["all_gather_bytes"] < 0.51 * ZP.zeropp_traffic(CFG, nproc)["all_gather_bytes"]
    assert f"hpz over nodes of {node}" in out
