"""Borrowed answers (gpullm_lessons/checks/borrowed.py): a graded answer that is, aliases, wraps or calls the course's own
implementation of its task is wrong, with a verdict that names what it borrowed; a right answer that uses the course's
other helpers (11.3 launches the course's delta and dK/dV kernels around its own dQ kernel) stays correct.

Each borrowed answer is the solution notebook with one edit (conftest.solution_namespace), graded as the grader does
(a task label given); the same call without a label (the course's own tests of its kernels) is not judged so.
"""

import numpy as np
import pytest
from conftest import solution_namespace

from gpullm_lessons.checks import borrowed
from gpullm_lessons import device
from gpullm_lessons.checks.flash import check_flash_attention_backward, check_flash_attention_forward
from gpullm_lessons.checks.scale import check_bucket_assignment, check_quantize_blockwise

numba_ok = pytest.mark.skipif(not device.numba_available(), reason="needs Numba (GPU or simulator)")
FLASH = "gpullm_lessons.kernels.numba.flash"

DQ_CALL = "    flash_dq_kernel[grid, ROWS](q, k, v, dout, lse, delta, dq, scale)"
FWD_CALL = "        flash_forward_kernel[(math.ceil(T / ROWS), B * nh), ROWS](q, k, v, out, lse, numba.float32(1 / math.sqrt(hs)))"


def borrowed_11_3():
    """11.3's borrowed answers: the course's dQ kernel aliased at the top of the cell, or launched by the launcher."""
    alias = ("e11-t3-code", "@cuda.jit\ndef flash_dq_kernel(", "flash_dq_kernel = flash.flash_attention_backward_v1_dq\n"
             "@cuda.jit\ndef my_unused_dq_kernel(")  # fmt: skip
    launch = ("e11-t3-code", DQ_CALL, DQ_CALL.replace("flash_dq_kernel", "flash.flash_attention_backward_v1_dq"))
    whole = ("e11-t3-code", DQ_CALL, "    flash.flash_attention_backward(q, k, v, out, dout, lse, dq, dk, dv)")
    return {"alias": alias, "launch": launch, "whole": whole}


@numba_ok
@pytest.mark.parametrize("how", ["alias", "launch", "whole"])
def test_11_3_borrowed_dq_is_wrong_and_named(how):
    ns = solution_namespace("11_flash_attention", [borrowed_11_3()[how]])
    r = check_flash_attention_backward(ns["flash_backward"], arrays="numba", task="11.3", seed=1, quiet=True)
    assert r.status == "wrong" and "course's own implementation" in r.message, r.message
    assert f"{FLASH}.flash_attention_backward" in r.message
    # the course's own tests run its kernels through the checker without a task label: not judged as borrowed
    plain = check_flash_attention_backward(ns["flash_backward"], arrays="numba", seed=1, quiet=True)
    assert plain.status == "correct", plain.message


@numba_ok
def test_11_2_borrowed_forward_kernel_is_wrong():
    edit = ("e11-t2-code", FWD_CALL, FWD_CALL.replace("flash_forward_kernel", "flash.flash_attention_forward_v1"))
    ns = solution_namespace("11_flash_attention", [edit])
    r = check_flash_attention_forward(ns["flash_forward"], arrays="numba", task="11.2", seed=1, quiet=True)
    assert r.status == "wrong" and f"{FLASH}.flash_attention_forward_v1" in r.message, r.message


@numba_ok
def test_the_solutions_using_other_course_kernels_stay_correct():
    ns = solution_namespace("11_flash_attention")
    r = check_flash_attention_backward(ns["flash_backward"], arrays="numba", task="11.3", seed=1, quiet=True)
    assert r.status == "correct", r.message  # it launches flash_attention_backward_v1_delta and _dkdv: allowed
    r = check_flash_attention_forward(ns["flash_forward"], arrays="numba", task="11.2", seed=1, quiet=True)
    assert r.status == "correct", r.message


def test_12_2_and_12_3_borrowed_answers_are_wrong_right_ones_correct():
    from gpullm_lessons.model import quant
    from gpullm_lessons.parallel import buckets

    ns = solution_namespace("12_memory")
    assert check_quantize_blockwise(ns["quantize"], ns["dequantize"], task="12.2", quiet=True).status == "correct"
    assert check_bucket_assignment(ns["assign_buckets"], task="12.3", quiet=True).status == "correct"
    answers = [
        (quant.quantize_blockwise, ns["dequantize"]),  # aliased
        (lambda x, block: quant.quantize_blockwise(x, block), ns["dequantize"]),  # wrapped
        (ns["quantize"], lambda q, s, block: quant.dequantize_blockwise(q, s, block)),  # the inverse borrowed
    ]
    for q, dq in answers:
        r = check_quantize_blockwise(q, dq, task="12.2", quiet=True)
        assert r.status == "wrong" and "gpullm_lessons.model.quant." in r.message, r.message

    def helper(sizes, limit):
        return buckets.assign_buckets(sizes, limit)

    for fn in (buckets.assign_buckets, lambda sizes, limit: helper(sizes, limit)):  # aliased; two calls deep
        r = check_bucket_assignment(fn, task="12.3", quiet=True)
        assert r.status == "wrong" and "assign_buckets" in r.message and "hint" in r.message, r.message


def test_what_the_detector_follows_and_what_it_leaves():
    from gpullm_lessons.model import quant

    own = ["gpullm_lessons.model.quant:quantize_blockwise"]

    def inner_import(x, block):
        from gpullm_lessons.model.quant import quantize_blockwise as qb

        return qb(x, block)

    def quantize_blockwise(x, block):  # the learner's own function with the course's name
        return np.rint(x), np.ones(1)

    def uses_own_name(x, block):
        return quantize_blockwise(x, block)

    def uses_other_helpers(x, block):
        return quant.dequantize_blockwise(*quant.quantize_blockwise.__name__, block)  # reads an attribute only

    assert borrowed.uses_own([inner_import], own) == "gpullm_lessons.model.quant.quantize_blockwise"
    assert borrowed.uses_own([uses_own_name], own) is None
    assert borrowed.uses_own([lambda x, b: quant.dequantize_blockwise(x, b)], own) is None
    named = borrowed.uses_own([uses_other_helpers], own)  # static: named
    assert named == "gpullm_lessons.model.quant.quantize_blockwise"


def test_lesson_01_answers_taken_from_the_reference_are_wrong():
    """01.1: the NumPy reference of lesson 01 (gpullm_lessons.reference) holds the answer; wrapping it is borrowing.
    The ops' own implementations are found by name (the reference, the Numba launcher and its versions)."""
    from gpullm_lessons.checks.backward import check_gelu_backward

    assert "gpullm_lessons.reference.gelu:gelu_backward" in borrowed.course_implementations("gelu_backward")
    assert "gpullm_lessons.kernels.numba.gelu:gelu_backward_v1" in borrowed.course_implementations("gelu_backward")

    def gelu_backward(dout, inp, dinp):
        from gpullm_lessons.reference import gelu

        dinp[...] = gelu.gelu_backward(dout, gelu.gelu_forward(inp)[1])

    r = check_gelu_backward(gelu_backward, task="01.1", quiet=True)
    assert r.status == "wrong" and "gpullm_lessons.reference.gelu.gelu_backward" in r.message, r.message
    ns = solution_namespace("01_numpy_reference_gradients")
    assert check_gelu_backward(ns["gelu_backward"], task="01.1", quiet=True).status == "correct"


# ---- the checkers that are not Op-based: each names its task's implementations in its module's OWN ---------------


@pytest.mark.parametrize(
    "module, check, spec",
    [
        ("checks.train", "check_lr_schedule", "gpullm_lessons.model.optim:lr_schedule"),
        ("checks.train", "check_clip_coef", "gpullm_lessons.model.optim:clip_coefficient"),
        ("checks.memory", "check_layernorm_rebuild", "gpullm_lessons.model.checkpointing:_layernorm_out"),
        ("checks.memory", "check_layernorm_rebuild", "gpullm_lessons.reference.layernorm:layernorm_forward"),
        ("checks.memory", "check_selective_rebuild", "gpullm_lessons.model.checkpointing:_rebuild_selective"),
        ("checks.parallel", "check_ring_allreduce_sim", "gpullm_lessons.parallel.ring:ring_allreduce_sim"),
        ("checks.parallel", "check_shard_bounds", "gpullm_lessons.parallel.data_parallel:shard_bounds"),
        ("checks.parallel", "check_shard_decay_table", "gpullm_lessons.model.optim:shard_decay_table"),
        ("checks.parallel", "check_zero_reduce_scatter", "gpullm_lessons.parallel.ring:ring_allreduce"),
        ("checks.optim", "check_adamw_step", "gpullm_lessons.model.optim:adamw_update"),
        ("checks.optim", "check_adamw_mixed", "gpullm_lessons.kernels.numba.adamw:adamw_step"),
        ("checks.precision", "check_bf16_rne", "gpullm_lessons.reference.rounding:f32_to_bf16_bits"),
        ("checks.precision", "check_loss_scaler_update", "gpullm_lessons.model.precision:DynamicLossScaler"),
        ("checks.precision", "check_bf16_kernel", "gpullm_lessons.kernels.numba.convert:f32_to_bf16"),
        ("checks.capstone", "check_engine_linear_backward", "gpullm_lessons.engine.gpu:GPUEngine._linear_backward"),
        ("checks.capstone", "check_block_forward", "gpullm_lessons.reference.gpt:block_forward"),
        ("checks.capstone", "check_block_backward", "gpullm_lessons.engine.gpu:GPUEngine._block_backward"),
        ("checks.capstone", "check_optimizer_step", "gpullm_lessons.engine.core:Engine.update"),
        ("checks.beyond", "check_column_parallel_backward", "gpullm_lessons.reference.linear:linear_backward"),
        ("checks.beyond", "check_attention_merge", "gpullm_lessons.parallel.ring_attention:merge_partials"),
        ("checks.beyond", "check_one_f_one_b", "gpullm_lessons.parallel.pipeline:one_f_one_b_schedule"),
        ("checks.beyond", "check_one_f_one_b", "gpullm_lessons.parallel.pipeline:timed_schedule"),
    ],
)
def test_borrowed_answers_to_the_other_checkers_are_wrong_and_named(module, check, spec):
    import functools
    import importlib

    check_fn = getattr(importlib.import_module(f"gpullm_lessons.{module}"), check)
    impl = borrowed._resolve(spec)
    named = spec.replace(":", ".")

    def wraps(*a, **k):  # a def that calls it
        return impl(*a, **k)

    for fn in (impl, lambda *a, **k: impl(*a, **k), wraps, functools.partial(impl)):
        r = check_fn(fn, task="graded", seed=1, quiet=True)
        assert r.status == "wrong" and "course's own implementation" in r.message, r.message
        assert named in r.message, r.message


def test_09_borrowed_through_the_engine_class_and_training_step():
    """GPUEngine._block_forward read off the class (engine.GPUEngine) is seen; 09.6 asks about all three functions."""
    from gpullm_lessons import engine
    from gpullm_lessons.checks.capstone import check_block_forward, check_training_step

    def block_forward(eng, x, l, B, T):
        return engine.GPUEngine._block_forward(eng, x, l, B, T, True)

    r = check_block_forward(block_forward, task="09.3", seed=1, quiet=True)
    assert r.status == "wrong" and "GPUEngine._block_forward" in r.message, r.message
    ns = solution_namespace("09_full_training_loop")
    r = check_training_step(ns["block_forward"], block_forward, ns["optimizer_step"], task="09.6", seed=1, quiet=True)
    assert r.status == "wrong" and "GPUEngine._block_forward" in r.message, r.message


@pytest.mark.parametrize(
    "lesson, module, answers",
    [
        ("09_full_training_loop", "checks.train", {"lr_schedule": "lr_at"}),
        (
            "09_full_training_loop",
            "checks.capstone",
            {
                "engine_linear_backward": "linear_backward",
                "block_forward": "block_forward",
                "block_backward": "block_backward",
                "optimizer_step": "optimizer_step",
                "training_step": "block_forward block_backward optimizer_step",
            },
        ),
        (
            "08_activation_checkpointing",
            "checks.memory",
            {"layernorm_rebuild": "layernorm_out", "selective_rebuild": "rebuild_block_cache"},
        ),
        (
            "10_multi_gpu",
            "checks.parallel",
            {
                "ring_allreduce_sim": "ring_allreduce_sim",
                "shard_bounds": "shard_bounds",
                "shard_decay_table": "shard_decay_table",
                "zero_reduce_scatter": "zero_reduce_scatter",
            },
        ),
        ("06_fused_adamw", "checks.optim", {"adamw_mixed": "adamw_step_mixed"}),
        (
            "13_beyond_one_gpu",
            "checks.beyond",
            {
                "column_parallel_backward": "column_parallel_backward",
                "attention_merge": "merge",
                "one_f_one_b": "one_f_one_b",
            },
        ),
        (
            "14_past_torch_compile",
            "checks.epilogue",
            {"matmul_bias_gelu": "matmul_bias_gelu", "matmul_dgelu_bgrad": "matmul_dgelu_bgrad"},
        ),
        (
            "07_mixed_precision",
            "checks.precision",
            {"bf16_rne": "f32_to_bf16_bits", "loss_scaler_update": "update_scale", "bf16_kernel": "f32_to_bf16_gpu"},
        ),
    ],
)
def test_the_solutions_borrow_nothing(lesson, module, answers):
    """The solutions' own answers (which use other course helpers: the engine's launchers, reference.gpt in 08.1,
    parallel.chunk_bounds, reference.gelu) are not taken for borrowed (their checks run in the task tests)."""
    import importlib

    own = importlib.import_module(f"gpullm_lessons.{module}").OWN
    ns = solution_namespace(lesson)
    for task, names in answers.items():
        assert borrowed.uses_own([ns[n] for n in names.split()], own[task]) is None, (task, names)


def test_solution_answers_to_quick_checkers_stay_correct():
    from gpullm_lessons.checks.memory import check_layernorm_rebuild
    from gpullm_lessons.checks.parallel import check_shard_bounds, check_shard_decay_table
    from gpullm_lessons.checks.precision import check_loss_scaler_update
    from gpullm_lessons.checks.train import check_lr_schedule

    ns9, ns8 = solution_namespace("09_full_training_loop"), solution_namespace("08_activation_checkpointing")
    ns10, ns7 = solution_namespace("10_multi_gpu"), solution_namespace("07_mixed_precision")
    assert check_lr_schedule(ns9["lr_at"], task="09.1", quiet=True).status == "correct"
    assert check_layernorm_rebuild(ns8["layernorm_out"], task="08.2", quiet=True).status == "correct"
    assert check_shard_bounds(ns10["shard_bounds"], task="10.2", quiet=True).status == "correct"
    assert check_shard_decay_table(ns10["shard_decay_table"], task="10.3", quiet=True).status == "correct"
    assert check_loss_scaler_update(ns7["update_scale"], task="07.2", quiet=True).status == "correct"
