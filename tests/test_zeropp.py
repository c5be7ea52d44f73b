"""ZeRO++'s qwZ and qgZ (parallel/zero3.py, ZeroPP) in one process (SingleComm: both quantisations still run, a world of one
rank's all-to-all is its own chunk): the loss curve against ZeRO-3's fp32 run within LOSS_GAP, a planted wrong
dequantisation caught by the same comparison, the bytes per step counted = predicted (about 3.9x fewer than fp32),
the fp32 master, and the zero3 command's --quantized. 2 and 4 MPI ranks: tests/test_zeropp_ranks.py."""

import contextlib
import io

import numpy as np
import pytest

from gpullm_lessons.model import quant
from gpullm_lessons.model.params import GPTConfig, init_params
from gpullm_lessons.parallel import zero3 as Z
from gpullm_lessons.parallel import zero3 as ZP
from gpullm_lessons.parallel.comm import SingleComm
from gpullm_lessons.train import ConfigError

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32)
# the zero3 command's tiny run (V = 256, the corpus' bytes): 10 steps, the training job's defaults
MODEL = ["--n-layer", "4", "--n-head", "2", "--d-model", "32", "--block-size", "16", "--batch-size", "8"]
MODEL += ["--steps", "10"]


def run(*extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        res = Z.main([*MODEL, *extra], comm=SingleComm())
    return res, out.getvalue()


@pytest.fixture(scope="module")
def fp32():
    return np.array(run()[0]["losses"])


def test_the_quantised_loss_curve_stays_within_the_bound(fp32):
    res, out = run("--quantized")
    gap = np.abs(np.array(res["losses"]) - fp32)
    assert gap.max() < ZP.LOSS_GAP  # measured 1.3e-2 (module docstring)
    assert gap.max() > 0  # the quantisation does change the numbers
    # the run learns far more than the bound: 0.39 nats here, 0.32 on the course's H100 image, whose Python's help
    # topics (the default corpus) differ; the test asks for five times the bound
    assert fp32[0] - fp32[-1] > 5 * ZP.LOSS_GAP
    assert "zero++ (qwZ + qgZ, int8 blocks of 256)" in out
    t = ZP.zeropp_traffic(GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, d_model=32), 1)
    assert res["traffic_bytes"] == t and res["block"] == 256 and res["quantized"] is True
    assert res["traffic_bytes_measured"] == {k: t[k] for k in ("all_gather_bytes", "reduce_scatter_bytes")}
    assert f"| bytes {t['total_bytes']:,}" in out


@pytest.mark.parametrize("mistake", ["scale twice", "scale missing"])
def test_a_wrong_dequantisation_is_caught_by_the_comparison(fp32, monkeypatch, mistake):
    ok = quant.dequantize_blockwise
    if mistake == "scale twice":
        bad = lambda q, s, block, signed: ok(q, s * s, block, signed)  # noqa: E731
    else:
        bad = lambda q, s, block, signed: ok(q, np.ones_like(s), block, signed)  # noqa: E731
    monkeypatch.setattr(ZP, "dequantize_blockwise", bad)
    res, _ = run("--quantized")
    assert np.abs(np.array(res["losses"]) - fp32).max() > 5 * ZP.LOSS_GAP  # measured 0.37 and 2.3


def test_bytes_per_step_counted_equal_predicted_and_about_4x_fewer():
    z = ZP.ZeroPP(CFG, SingleComm(), init_params(CFG, seed=0))
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (8, 16)), rng.integers(0, 64, (8, 16))
    res = z.train_step(x, y, 1e-3, 0.1, 1.0)
    t = ZP.zeropp_traffic(CFG, 1)
    assert (res["all_gather_bytes"], res["reduce_scatter_bytes"]) == (t["all_gather_bytes"], t["reduce_scatter_bytes"])
    z3 = Z.zero3_traffic(CFG, 1)
    assert (res["all_gather"], res["reduce_scatter"]) == (z3["all_gather"], z3["reduce_scatter"])  # elements
    assert res["peak_bytes"] == Z.zero3_memory(CFG, 1)["peak"]  # the fp32 gathered buffers, as ZeRO-3's
    for W in (1, 2, 4, 8):
        t = ZP.zeropp_traffic(CFG, W)
        sizes = Z.unit_sizes(CFG, W)
        per = [W * (s + 4 * -(-s // 256)) for _, s in sizes]
        assert t["all_gather_bytes"] == 2 * sum(per) - per[-1] and t["reduce_scatter_bytes"] == sum(per)
        assert t["zero3_total_bytes"] == 4 * Z.zero3_traffic(CFG, W)["total"]
        assert 3.9 < t["ratio"] < 4 and t["zero3_all_gather_bytes"] / t["all_gather_bytes"] > 3.9
        assert t["sent_per_rank"] == (W - 1) * t["total_bytes"] // W
    assert ZP.zeropp_traffic(CFG, 2, block=32)["ratio"] == pytest.approx(4 / (1 + 4 / 32))


def test_the_master_stays_fp32_only_the_gathered_copy_is_int8():
    init = init_params(CFG, seed=0).flat
    z = ZP.ZeroPP(CFG, SingleComm(), init)
    assert np.array_equal(z.full_params(), init)  # the master: exact fp32 (full_params gathers it in fp32)
    P = z.gather(1)
    shard = z.shard(1)
    q, s = quant.quantize_blockwise(shard, 256)
    assert np.array_equal(P["_flat"], quant.dequantize_blockwise(q, s, 256))
    assert 0 < np.abs(P["_flat"] - shard).max() <= s.max() / 254 * (1 + 1e-6)  # half a level at most
    assert P["_flat"].dtype == np.float32 and z.params.dtype == np.float32
    msg = ZP.pack(shard, 256)
    assert msg.dtype == np.uint8 and msg.size == ZP.packed_bytes(shard.size, 256) == shard.size + 4 * s.size
    np.testing.assert_array_equal(ZP.unpack(msg, shard.size, 256), P["_flat"])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="block must be a positive integer"):
        ZP.ZeroPP(CFG, SingleComm(), init_params(CFG, seed=0), block=0)
    with pytest.raises(ValueError, match="block must be a positive integer"):
        ZP.zeropp_traffic(CFG, 2, block=True)
    with pytest.raises(ConfigError, match="pass --quantized too"):
        run("--block", "64")
    with pytest.raises(ConfigError, match="--block must be a positive integer"):
        run("--quantized", "--block", "0")
    assert "ZeroPP(rank 0/1" in repr(ZP.ZeroPP(CFG, SingleComm(), init_params(CFG, seed=0), block=64))


def test_hpz_on_one_rank_is_zeropp_bitwise_and_counts_its_copies():
    """hpZ (ZeroPP(node=k)) keeps the first gather's int8 messages and reads them back for the second gather, so the
    losses are ZeroPP's bit for bit; the copies held and the bytes moved are hpz_model's."""
    base, _ = run("--quantized")
    res, out = run("--quantized", "--hpz", "1")
    assert res["losses"] == base["losses"]
    model = ZP.hpz_model(GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, d_model=32), 1, 1)
    assert res["hpz_model"] == model and res["hpz_measured"] == model and "hpz over nodes of 1" in out
    assert model["all_gather_bytes"] + model["node_gather_bytes"] == res["traffic_bytes"]["all_gather_bytes"]


def test_hpz_copies_that_are_never_used_are_named_and_bad_nodes_refused():
    z = ZP.ZeroPP(CFG, SingleComm(), init_params(CFG, seed=0), node=1)
    z.secondary[42] = np.zeros(4, np.uint8)  # a copy kept that no gather consumes
    rng = np.random.default_rng(0)
    with pytest.raises(RuntimeError, match=r"hpZ copies of units \[42\] were never used"):
        z.train_step(rng.integers(0, 64, (2, 16)), rng.integers(0, 64, (2, 16)), 1e-3)
    with pytest.raises(ValueError, match="node size .* must be a positive integer that divides the 1 ranks"):
        ZP.ZeroPP(CFG, SingleComm(), init_params(CFG, seed=0), node=2)
    with pytest.raises(ConfigError, match="pass --quantized too"):
        run("--hpz", "1")
    with pytest.raises(ConfigError, match="--hpz 3: the node size must be a positive divisor of the 1 ranks"):
        run("--quantized", "--hpz", "3")
