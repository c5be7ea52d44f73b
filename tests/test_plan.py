"""parallel/plan.py (lesson 13): the model state per rank of each strategy, the fits table, the alpha-beta fit and
the collectives of a step."""

import math

import numpy as np
import pytest

from gpullm_lessons.model.params import GPTConfig, num_params
from gpullm_lessons.parallel import plan, tensor, ulysses, zero3
from gpullm_lessons.parallel.data_parallel import shard_size
from gpullm_lessons.parallel.pipeline import Stage
from gpullm_lessons.model.params import init_params

CFG = GPTConfig(vocab_size=97, block_size=16, n_layer=4, n_head=4, d_model=32)
PSI = num_params(CFG)


@pytest.mark.parametrize("precision,K", [("fp32", 16), ("bf16", 18), ("fp16", 18)])
def test_data_parallel_and_zero_1_2_are_the_papers_formulas(precision, K):
    h = K - 16
    for N in (1, 2, 3, 8):
        S = shard_size(PSI, N, 64)
        assert plan.state_per_rank(CFG, N, "dp", precision)["total"] == K * PSI
        assert plan.state_per_rank(CFG, N, "zero1", precision)["total"] == (8 + h) * PSI + 8 * S
        assert plan.state_per_rank(CFG, N, "zero2", precision)["total"] == (4 + h) * PSI + 12 * S


def test_zero3_and_tensor_scale_the_modules_own_fp32_models():
    for N in (1, 2, 4):
        z, t = zero3.zero3_memory(CFG, N), tensor.tp_memory(CFG, N)
        assert plan.state_per_rank(CFG, N, "zero3", "fp32")["total"] == z["peak"]  # fp32: exactly what Zero3 measures
        assert plan.state_per_rank(CFG, N, "tensor", "fp32")["total"] == t["total"]
        bf = plan.state_per_rank(CFG, N, "zero3", "bf16")
        assert bf["total"] == 18 * z["shard_elements"] + 6 * z["gathered_peak"] // 4  # half copy + fp32 grad gathered


def test_pipeline_is_the_largest_stage_as_the_stages_hold_it():
    params = init_params(CFG, seed=0)
    for p in (1, 2, 3, 4):
        held = max(Stage(CFG, s, p, params).params.size for s in range(p))  # what each stage really allocates
        assert plan.state_per_rank(CFG, p, "pipeline", "fp32")["total"] == 16 * held


def test_each_strategy_shrinks_with_N_and_refuses_a_split_it_cannot_make():
    for s in plan.STRATEGIES:
        a, b = plan.state_per_rank(CFG, 1, s)["total"], plan.state_per_rank(CFG, 4, s)["total"]
        assert (a == b) if s in ("dp", "ulysses") else (b < a), s  # Ulysses splits activations, not the state
    with pytest.raises(ValueError, match="4 heads do not divide over 3 ranks"):
        plan.state_per_rank(CFG, 3, "tensor")
    with pytest.raises(ValueError, match="4 blocks, 5 stages"):
        plan.state_per_rank(CFG, 5, "pipeline")
    with pytest.raises(ValueError, match="strategy must be one of"):
        plan.state_per_rank(CFG, 2, "fsdp")
    with pytest.raises(ValueError, match="precision must be"):
        plan.state_per_rank(CFG, 2, "dp", "int8")
    with pytest.raises(ValueError, match="world must be a positive int"):
        plan.state_per_rank(CFG, 0, "dp")


def test_fits_table_gives_the_fewest_ranks_that_fit():
    card = plan.state_per_rank(CFG, 4, "zero3")["total"]  # exactly ZeRO-3's need on 4 ranks
    row = plan.fits_table({"m": CFG}, card)[0]
    assert row["zero3"] == 4 and row["dp"] is None and row["psi"] == PSI
    assert plan.state_per_rank(CFG, 2, "zero3")["total"] > card  # 2 would not have fitted
    assert row["tensor"] is None or plan.why_not(CFG, row["tensor"], "tensor") is None
    with pytest.raises(ValueError, match="card_bytes"):
        plan.fits_table({"m": CFG}, 0)


def test_fit_alpha_beta_recovers_the_numbers_it_was_made_from():
    alpha, beta, N = 20e-6, 1 / 300e9, 4
    sizes = [2**k for k in range(10, 31, 2)]
    rows = [{"size_bytes": n, "time_us": 1e6 * (alpha + 1.5 * n * beta), "algo": "nccl"} for n in sizes]
    rows += [{"size_bytes": 1024, "time_us": 1e9, "algo": "ring"}]  # another algorithm's row: filtered out
    fit = plan.fit_alpha_beta(rows, N, algo="nccl")
    assert math.isclose(fit["alpha"], alpha, rel_tol=1e-9) and math.isclose(fit["busbw_GBps"], 300, rel_tol=1e-9)
    assert max(abs(e) for e in fit["rel_err"]) < 1e-9 and fit["sizes"] == sizes
    # a wrong ring factor (busbw read as algbw) is a different beta: the fit is about the buffer's bytes on the ring
    assert not math.isclose(plan.fit_alpha_beta(rows, 2, algo="nccl")["busbw_GBps"], 300, rel_tol=0.1)
    with pytest.raises(ValueError, match="at least two timings"):
        plan.fit_alpha_beta(rows[:1], N)
    with pytest.raises(ValueError, match="one rank moves nothing"):
        plan.fit_alpha_beta(rows, 1)


def test_the_collectives_of_a_step():
    B, T, C, L = 8, 16, CFG.d_model, CFG.n_layer
    assert plan.comm_per_step(CFG, B, T, 2, "tensor") == [("all_reduce", 2 * B * T * C)] * (4 * L)
    assert plan.comm_per_step(CFG, B, T, 2, "tensor", "fp32") == [("all_reduce", 4 * B * T * C)] * (4 * L)
    dp = plan.comm_per_step(CFG, B, T, 2, "dp", bucket_bytes=10_000)
    assert sum(n for _, n in dp) == 4 * PSI and len(dp) == math.ceil(4 * PSI / 10_000)
    z3 = plan.comm_per_step(CFG, B, T, 4, "zero3", "fp32")
    traffic = zero3.zero3_traffic(CFG, 4)
    assert sum(n for k, n in z3 if k == "all_gather") == 4 * traffic["all_gather"]
    assert sum(n for k, n in z3 if k == "reduce_scatter") == 4 * traffic["reduce_scatter"]
    assert len(z3) == 2 * (L + 1) + 1 + (L + 2)
    assert plan.comm_per_step(CFG, B, T, 3, "pipeline", micro_batches=4) == [("sendrecv", 2 * 2 * T * C)] * 8
    assert plan.comm_per_step(CFG, B, T, 2, "pipeline", micro_batches=4) == [("sendrecv", 2 * 2 * T * C)] * 4
    ul = plan.comm_per_step(CFG, B, T, 4, "ulysses", "fp32")
    traffic = ulysses.ulysses_traffic(CFG, 4, B, T)
    assert (
        sum(n for k, n in ul if k == "all_to_all") == 4 * traffic["all_to_all"]
        and len(ul) == traffic["all_to_alls"] + 1
    )
    assert ul[-1] == ("all_reduce", 4 * traffic["grad_all_reduce"])
    with pytest.raises(ValueError, match="do not divide B=8"):
        plan.comm_per_step(CFG, B, T, 2, "pipeline", micro_batches=3)
    calls = [("all_reduce", 1000), ("all_gather", 1000), ("sendrecv", 1000)]
    assert math.isclose(plan.sent_bytes(calls, 4), 1500 + 750 + 1000)
    assert math.isclose(plan.comm_seconds(calls, 4, 1e-5, 1e-9), 3e-5 + 3250e-9)
    assert plan.comm_seconds([("all_reduce", 10**9)], 1, 1e-5, 1e-9) == 0.0  # one rank: nothing to send
    with pytest.raises(ValueError, match="unknown collective"):
        plan.collective_seconds("broadcast", 10, 2, 1e-5, 1e-9)
    assert np.isfinite(plan.comm_seconds(plan.comm_per_step(CFG, B, T, 4, "zero3"), 4, 1e-5, 1e-9))


def test_state_curves_and_the_lessons_figures():
    from gpullm_lessons import viz

    curves = plan.state_curves(CFG, worlds=(1, 2, 3, 4))
    assert [N for N, _ in curves["tensor"]] == [1, 2, 4]  # 4 heads do not split over 3 ranks
    assert curves["zero3"][1] == (2, plan.state_per_rank(CFG, 2, "zero3")["total"])
    fig = viz.plot_state_per_rank(curves, "test", card_bytes=10**6)
    assert len(fig.axes[0].get_lines()) == len(plan.STRATEGIES) + 1  # one line per strategy and the card's
    rows = [{"size_bytes": n, "time_us": 1e6 * (2e-5 + n / 3e11)} for n in (1024, 2**20, 2**26)]
    fig = viz.plot_alpha_beta(rows, plan.fit_alpha_beta(rows, 2), 2, "test")
    assert len(fig.axes[0].get_lines()) == 2
