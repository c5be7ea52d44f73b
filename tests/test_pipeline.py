"""Pipeline parallelism (parallel/pipeline.py) in one process: the schedules as tables (bubble, memory, the checks
that catch a wrong table), the stages' split of the model, and the step with all stages in one process against the
one-rank NumPy engine (bitwise where the arithmetic is the same, to rounding where it is not). The step on real MPI
ranks is tests/test_pipeline_ranks.py."""

import re

import numpy as np
import pytest

from gpullm_lessons import engine
from gpullm_lessons.model.params import GPTConfig, init_params, num_params
from gpullm_lessons.parallel import pipeline as PP
from gpullm_lessons.parallel.comm import SingleComm

SCHEDULES = {"gpipe": PP.gpipe_schedule, "1f1b": PP.one_f_one_b_schedule}
SIZES = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 8), (3, 4), (4, 4), (4, 7), (4, 16), (8, 3), (8, 32)]


# ---- the schedules: pure functions of (p, m) -----------------------------------------------------------------------


@pytest.mark.parametrize("backward_cost", [1, 2])
@pytest.mark.parametrize("p, m", SIZES)
def test_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m, backward_cost):
    s = PP.gpipe_schedule(p, m, backward_cost)
    PP.validate_schedule(s, m, backward_cost)
    assert len(s) == (1 + backward_cost) * (m + p - 1)  # the fill and the drain of each direction: p - 1 ticks
    assert PP.bubble_fraction(s) == (p - 1) / (m + p - 1)  # both correctly rounded quotients of one fraction


@pytest.mark.parametrize("backward_cost", [1, 2])
@pytest.mark.parametrize("p, m", SIZES)
def test_1f1b_has_gpipe_bubble_and_holds_p_minus_s(p, m, backward_cost):
    s = PP.one_f_one_b_schedule(p, m, backward_cost)
    PP.validate_schedule(s, m, backward_cost)
    assert PP.bubble_fraction(s) == (p - 1) / (m + p - 1)
    assert PP.peak_activations(s) == [min(p - stage, m) for stage in range(p)]
    assert PP.peak_activations(PP.gpipe_schedule(p, m, backward_cost)) == [m] * p


def test_1f1b_memory_does_not_grow_with_m():
    """The point of 1F1B: more micro-batches shrink the bubble, and stage s still holds p - s of them."""
    p = 4
    for m in (4, 8, 32):
        assert PP.peak_activations(PP.one_f_one_b_schedule(p, m)) == [4, 3, 2, 1]
        assert PP.peak_activations(PP.gpipe_schedule(p, m)) == [m] * 4
    assert PP.bubble_fraction(PP.one_f_one_b_schedule(p, 32)) < PP.bubble_fraction(PP.one_f_one_b_schedule(p, 4))


def test_the_tables_of_the_docstring_are_format_schedules():
    for make in SCHEDULES.values():
        table = PP.format_schedule(make(3, 4))
        for line in table.splitlines():
            assert line in PP.__doc__, f"the module docstring does not show this line of the table:\n{line}"
    assert PP.format_schedule(PP.gpipe_schedule(2, 2)).splitlines() == [
        "tick    0  1  2  3  4  5",
        "stage 0 F0 F1 .  .  B0 B1",
        "stage 1 .  F0 F1 B0 B1 .",
    ]


def test_backward_cost_2_repeats_the_backward_cell():
    s = PP.gpipe_schedule(2, 2, backward_cost=2)
    assert [tick[1] for tick in s] == [None, ("F", 0), ("F", 1), ("B", 0), ("B", 0), ("B", 1), ("B", 1), None, None]
    with pytest.raises(ValueError, match="runs the backward B0 for 2 tick.*takes 1"):
        PP.validate_schedule(s, 2)  # read with the wrong cost
    PP.validate_schedule(s, 2, backward_cost=None)  # the table's own


# ---- validate_schedule catches planted faults ----------------------------------------------------------------------


def _cells(schedule):
    return [list(tick) for tick in schedule]


def _tick(cells, s, op):
    """The tick at which stage s runs op."""
    return next(t for t, tick in enumerate(cells) if tick[s] == op)


def _table(cells):
    return [tuple(row) for row in cells]


def test_a_backward_before_its_forward_is_caught():
    c = _cells(PP.gpipe_schedule(2, 2))  # stage 0: F0 F1 .  .  B0 B1
    b0 = _tick(c, 0, ("B", 0))
    c[0][0], c[b0][0] = c[b0][0], c[0][0]  # stage 0: B0 F1 .  .  F0 B1
    with pytest.raises(ValueError, match=r"tick 0, stage 0 starts the backward B0 before the forward F0 of stage 0"):
        PP.validate_schedule(_table(c), 2)


def test_a_backward_before_the_next_stage_sent_its_gradient_is_caught():
    c = _cells(PP.gpipe_schedule(2, 2))  # stage 0: F0 F1 .  .  B0 B1 ; stage 1: .  F0 F1 B0 B1 .
    b0 = _tick(c, 0, ("B", 0))
    c[b0 - 1][0], c[b0][0] = c[b0][0], None  # stage 0's B0 one tick early: in the tick of stage 1's B0
    with pytest.raises(ValueError, match=r"tick 3, stage 0 starts the backward B0 before the backward B0 of stage 1"):
        PP.validate_schedule(_table(c), 2)


def test_a_forward_before_the_previous_stage_is_caught():
    c = _cells(PP.one_f_one_b_schedule(3, 3))
    c[0][1] = ("F", 0)  # stage 1 starts F0 together with stage 0
    c[1][1] = None
    with pytest.raises(ValueError, match=r"tick 0, stage 1 starts the forward F0 before the forward F0 of stage 0"):
        PP.validate_schedule(_table(c), 3)


def test_a_stage_doing_two_things_in_one_tick_is_caught():
    c = _cells(PP.one_f_one_b_schedule(2, 3))
    c[3][1] = (("F", 1), ("B", 0))  # as if stage 1 ran both in tick 3
    with pytest.raises(ValueError, match=r"tick 3, stage 1 does 2 things at once.*one forward or backward per tick"):
        PP.validate_schedule(_table(c), 3)


def test_a_missing_micro_batch_is_caught():
    full = PP.gpipe_schedule(3, 4)
    gone = _table([[None if cell == ("B", 2) and s == 1 else cell for s, cell in enumerate(tick)] for tick in full])
    with pytest.raises(ValueError, match=r"stage 1 never runs the backward B2"):
        PP.validate_schedule(gone, 4)
    last = _table([[None if cell is not None and cell[1] == 3 else cell for cell in tick] for tick in full])
    PP.validate_schedule(last, 3)  # without micro-batch 3 anywhere it is a schedule of 3 ...
    with pytest.raises(ValueError, match=r"stage 0 never runs the forward F3 \(micro-batches 0..3\)"):
        PP.validate_schedule(last, 4)  # ... which m=4 catches


def test_a_repeated_op_and_malformed_tables_are_caught():
    c = _cells(PP.gpipe_schedule(2, 2))
    c[2][0] = ("F", 0)  # stage 0: F0 F1 F0 B0 B1
    with pytest.raises(ValueError, match=r"stage 0 runs the forward F0 twice \(from tick 0 and from tick 2\)"):
        PP.validate_schedule(_table(c), 2)
    with pytest.raises(ValueError, match=r"tick 1 has 1 cells and tick 0 has 2"):
        PP.validate_schedule([(("F", 0), None), (("F", 1),)])
    with pytest.raises(ValueError, match=r"tick 0, stage 0: a cell is None or \('F', i\)"):
        PP.validate_schedule([("X", None)])
    with pytest.raises(ValueError, match=r"names micro-batch 5; micro-batches are whole numbers in 0..1"):
        PP.validate_schedule([(("F", 5),)], m=2)
    with pytest.raises(ValueError, match="non-empty list of ticks"):
        PP.validate_schedule([])
    with pytest.raises(ValueError, match="runs nothing"):
        PP.validate_schedule([(None, None)])


def test_orders_that_cannot_run_stall_with_the_stages_named():
    with pytest.raises(ValueError, match=r"the orders stall \(stage 0 at B0\)"):
        PP.timed_schedule([[("B", 0), ("F", 0)]])
    with pytest.raises(ValueError, match=r"stall \(stage 0 at B0, stage 1 at F0\)"):
        PP.timed_schedule([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])
    with pytest.raises(ValueError, match=r"an op is \('F', i\) or \('B', i\)"):
        PP.timed_schedule([[("X", 0)]])


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: PP.gpipe_schedule(0, 4), "p (stages) must be a whole number >= 1, got 0"),
        (lambda: PP.one_f_one_b_schedule(2, 0), "m (micro-batches) must be a whole number >= 1, got 0"),
        (lambda: PP.gpipe_schedule(2, 2.5), "m (micro-batches) must be a whole number >= 1, got 2.5"),
        (lambda: PP.gpipe_schedule(2, 2, backward_cost=0), "backward_cost must be a whole number >= 1"),
        (lambda: PP.make_schedule("zb", 2, 2), "unknown schedule 'zb': choose one of gpipe, 1f1b"),
        (lambda: PP.stage_layers(4, 5), "5 stages but the model has 4 blocks"),
        (lambda: PP.stage_ranges(GPTConfig(n_layer=2), 2, 2), "stage must be in 0..1, got 2"),
    ],
)
def test_bad_input_is_named(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()


# ---- the stages ----------------------------------------------------------------------------------------------------

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32)


def test_stage_layers_are_contiguous_and_balanced():
    assert PP.stage_layers(4, 2) == [(0, 2), (2, 4)]
    assert PP.stage_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert PP.stage_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_the_stages_hold_the_model_once_and_wte_twice(p):
    counts = np.zeros(num_params(CFG), int)
    for s in range(p):
        counts[np.concatenate([np.arange(lo, hi) for _, lo, hi, _ in PP.stage_ranges(CFG, s, p)])] += 1
    wte = CFG.vocab_size * CFG.d_model
    assert (counts[wte:] == 1).all()
    assert (counts[:wte] == (1 if p == 1 else 2)).all()  # the embedding on stage 0, the tied head on the last


def test_stage_params_are_the_whole_models_slices():
    full = init_params(CFG, seed=3)
    st = PP.Stage(CFG, 1, 2, full)
    assert st.P["qkvw"].shape == (2, 32, 96) and "wte" in st.P and "wpe" not in st.P and "lnfw" in st.P
    np.testing.assert_array_equal(st.P["qkvw"], full["qkvw"][2:4])
    np.testing.assert_array_equal(st.P["wte"], full["wte"])
    assert np.shares_memory(st.P["qkvw"], st.params)  # views into the stage's one flat buffer
    assert "blocks [2, 4) + final LayerNorm and head" in repr(st)


# ---- the step, all stages in one process, against the one-rank engine ---------------------------------------------


def _batches(n, B=8, T=16, seed=0):
    """n batches of random tokens, each target the next token id (something to learn)."""
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, CFG.vocab_size, (B, T)) for _ in range(n)]
    return [(x, (x + 1) % CFG.vocab_size) for x in xs]


def _stages(p):
    full = init_params(CFG, seed=0)
    return [PP.Stage(CFG, s, p, full) for s in range(p)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("p", [1, 2, 4])
def test_one_step_gives_the_engines_micro_batched_gradients(p, schedule):
    """Before any update the forwards are the engine's on the same micro-batches: the loss is bitwise equal, and so is
    every gradient except wte's, whose two uses (stage 0, stage p-1) are added after the micro-batches, not per
    micro-batch (one stage: bitwise too)."""
    m = 4
    ((x, y),) = _batches(1)
    eng = engine.build(CFG, "numpy", seed=0)
    loss = eng.forward_backward(x, y, micro_batches=m)
    stages = _stages(p)
    res = PP.simulate_step(stages, SCHEDULES[schedule](p, m), x, y, lr=0.0)
    assert res["loss"] == loss
    grad = np.zeros(num_params(CFG), np.float32)
    for st in reversed(stages):
        grad[st.index] = st.acc
    wte = CFG.vocab_size * CFG.d_model
    np.testing.assert_array_equal(grad[wte:], eng.grads.flat[wte:])
    if p == 1:
        np.testing.assert_array_equal(grad[:wte], eng.grads.flat[:wte])
    else:
        np.testing.assert_allclose(grad[:wte], eng.grads.flat[:wte], rtol=1e-5, atol=1e-9)
        np.testing.assert_array_equal(stages[0].acc[stages[0].wte], stages[-1].acc[stages[-1].wte])
    assert [st.peak for st in stages] == PP.peak_activations(SCHEDULES[schedule](p, m))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("p", [1, 2, 4])
def test_training_gives_the_one_rank_losses(p, schedule):
    """Three AdamW steps with clipping: one stage is the engine on m micro-batches bit for bit; p stages equal it to
    rounding, and the engine on the whole batch (no micro-batches) as well; wte's two copies stay bitwise equal."""
    m, steps = 4, 3
    stages = _stages(p)
    micro, whole = engine.build(CFG, "numpy", seed=0), engine.build(CFG, "numpy", seed=0)
    got, ref, ref_whole = [], [], []
    for x, y in _batches(steps):
        kw = dict(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
        got.append(PP.simulate_step(stages, SCHEDULES[schedule](p, m), x, y, **kw)["loss"])
        ref.append(micro.train_step(x, y, micro_batches=m, **kw)["loss"])
        ref_whole.append(whole.train_step(x, y, **kw)["loss"])
    if p == 1:
        assert got == ref
        np.testing.assert_array_equal(PP.assemble_params(stages), micro.params.flat)
    else:
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(stages[0].P["wte"], stages[-1].P["wte"])
    np.testing.assert_allclose(got, ref_whole, rtol=0, atol=1e-5)
    assert got[-1] < got[0]


def test_any_valid_table_gives_the_same_step():
    """The step follows the table, whatever it is: a 2-tick backward, or a table written by hand with lists, give the
    numbers of the plain 1F1B table (the same ops, each stage's in the same order)."""
    ((x, y),) = _batches(1)
    results = []
    for table in (
        PP.one_f_one_b_schedule(4, 4),
        PP.one_f_one_b_schedule(4, 4, backward_cost=2),
        [[None if c is None else list(c) for c in tick] for tick in PP.one_f_one_b_schedule(4, 4)],
    ):
        stages = _stages(4)
        results.append((PP.simulate_step(stages, table, x, y, lr=1e-2, grad_clip=1.0), PP.assemble_params(stages)))
    for res, params in results[1:]:
        assert res == results[0][0]
        np.testing.assert_array_equal(params, results[0][1])


def test_the_step_refuses_a_batch_that_does_not_split_and_a_wrong_world():
    ((x, y),) = _batches(1, B=6)
    with pytest.raises(ValueError, match="batch of 6 rows does not split into m=4 micro-batches"):
        PP.simulate_step(_stages(2), PP.gpipe_schedule(2, 4), x, y, lr=0.0)
    with pytest.raises(ValueError, match="the schedule has 3 stages and there are 2"):
        PP.simulate_step(_stages(2), PP.gpipe_schedule(3, 2), x, y, lr=0.0)
    with pytest.raises(ValueError, match="start one rank per stage"):
        PP.run_schedule(_stages(2)[1], SingleComm(), PP.gpipe_schedule(2, 2), x, y)


# ---- the command on one process ------------------------------------------------------------------------------------

ARGS = ["--n-layer", "2", "--n-head", "2", "--d-model", "16", "--block-size", "8", "--batch-size", "4", "--steps", "2"]


def test_the_command_on_one_rank_is_gradient_accumulation(capsys, tmp_path):
    out = PP.main(ARGS + ["--micro-batches", "2", "--json", str(tmp_path / "pp.json")], comm=SingleComm())
    text = capsys.readouterr().out
    assert "stage 0 F0 B0 F1 B1" in text and "step    2 | loss" in text
    assert out["peak_activations"] == [1] and out["bubble"] == 0.0 and len(out["losses"]) == 2
    assert (tmp_path / "pp.json").exists()


class _FourRanks(SingleComm):
    def __init__(self):
        super().__init__()
        self.world_size = 4


@pytest.mark.parametrize(
    "extra, comm, words",
    [
        (["--micro-batches", "3"], SingleComm(), "--micro-batches 3 does not divide the batch of 4 sequences"),
        (["--micro-batches", "0"], SingleComm(), "--micro-batches must be a positive integer, got 0"),
        ([], _FourRanks(), "4 ranks \\(one stage each\\) but the model has 2 blocks \\(--n-layer\\)"),
    ],
)
def test_the_command_names_bad_settings(extra, comm, words):
    from gpullm_lessons.train import ConfigError

    with pytest.raises(ConfigError, match=words):
        PP.main(ARGS + extra, comm=comm)
