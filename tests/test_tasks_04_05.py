"""Graded tasks 04.1-04.2 and 05.1-05.5: the solutions pass, plausible wrong answers fail with a hint naming them.

The solutions are the code cells of solutions/04_*.ipynb and solutions/05_*.ipynb, executed here (checker cells
left out). A wrong answer is the same code with one edit (`load(..., edits=[(cell id, old, new)])`: the edit must
match, so a changed solution fails loudly instead of testing nothing), or a short NumPy function for the mistake
tables (fast). Numba kernels run in the CUDA simulator here; `gpu` tests run them at GPU sizes on a GPU.
"""
import linecache

import nbformat
import numpy as np
import pytest
from numba import cuda, float32

from gpullm_lessons.checks import ops as checks_ops
from gpullm_lessons import device
from gpullm_lessons.checks.backward import check_gelu_backward, check_layernorm_backward
from gpullm_lessons.checks.ops import (check_attention_softmax_backward, check_crossentropy_online,
                                       check_encoder_backward_atomic, check_encoder_backward_deterministic,
                                       check_layernorm_dparams)

from conftest import ROOT

NB04 = ROOT / "solutions" / "04_layernorm_backward.ipynb"
NB05 = ROOT / "solutions" / "05_gelu_attention_cross_entropy.ipynb"
SIM = not device.numba_on_gpu()
sim_only = pytest.mark.skipif(not SIM, reason="relies on the simulator reading a kernel's globals at run time")


def load(path, edits=()):
    """Run the notebook's code cells (not the checker calls) in a fresh namespace, after applying `edits`:
    (cell id, old text, new text), each old text found exactly once in that cell."""
    nb = nbformat.read(str(path), as_version=4)
    todo = list(edits)
    ns = {"__name__": "solution"}
    for cell in nb.cells:
        if cell.cell_type != "code" or cell.source.lstrip().startswith("check_") or "show_kernel(" in cell.source:
            continue
        src = cell.source
        for cid, old, new in [e for e in todo if e[0] == cell.id]:
            assert src.count(old) == 1, f"edit not found once in cell {cid}: {old!r}"
            src = src.replace(old, new)
            todo.remove((cid, old, new))
        filename = f"<{path.parent.name}/{path.name}:{cell.id}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)   # as IPython does for a cell
        exec(compile(src, filename, "exec"), ns)
    assert not todo, f"cells not found for edits: {todo}"
    return ns


def wrong(result, *words):
    """The verdict is 'wrong' and its hint contains every one of `words` (case-insensitive)."""
    assert result.status == "wrong", result.message
    hint = (result.hint or "").lower()
    for w in words:
        assert w.lower() in hint, f"{w!r} not in the hint: {result.message}"


# ------------------------------------------------------------------------------------------------------------
# 04.1 dinp with a block tree reduction (check_layernorm_backward)
# ------------------------------------------------------------------------------------------------------------
def test_04_1_solution_passes():
    ns = load(NB04)
    r = check_layernorm_backward(ns["layernorm_backward"], arrays="numba", seed=11, quiet=True)
    assert r.status == "correct", r.message


def test_04_1_partial_sums_without_the_stride_over_channels_fail():
    # each thread takes only channel tid: rows longer than the block lose their other channels
    own_channels = ("for i in range(tid, C, THREADS):                 "
                    "# this thread's channels: coalesced across the block")
    ns = load(NB04, [("72e92837", own_channels, "for i in range(tid, min(C, THREADS), THREADS):")])
    r = check_layernorm_backward(ns["layernorm_backward"], arrays="numba", seed=11, quiet=True)
    assert r.status == "wrong" and r.output == "dinp", r.message


# ------------------------------------------------------------------------------------------------------------
# 04.2 deterministic two-stage dweight / dbias (check_layernorm_dparams)
# ------------------------------------------------------------------------------------------------------------
def test_04_2_solution_passes_with_every_rule_checked():
    ns = load(NB04)
    r = check_layernorm_dparams(ns["layernorm_dparams"], arrays="numba", seed=5, quiet=True)
    assert r.status == "correct", r.message
    assert "same bits twice" in r.message
    if SIM:
        assert "no float atomics (traced)" in r.message and "split over the rows" in r.message


def test_04_2_checker_sizes_have_a_partial_last_chunk_and_a_partial_last_block():
    for size in ("small", "large"):
        dims = checks_ops._LN_DIMS[size]
        for N, C in dims:
            for rows_per_chunk in (2, 4, 8, 16, 32):
                if N > rows_per_chunk:
                    assert N % rows_per_chunk, (N, rows_per_chunk)
        for threads in (8, 32, 128, 256):
            assert any(C % threads and C > threads for _, C in dims) or size == "small" and threads > 32
        assert min(N for N, _ in dims) < {"small": 4, "large": 32}[size]     # fewer rows than one chunk


def test_04_2_dropping_the_partial_last_chunk_is_named():
    ns = load(NB04, [("ex04-dparams-code", "n_chunks = (N + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK",
                      "n_chunks = max(1, N // ROWS_PER_CHUNK)")])
    wrong(check_layernorm_dparams(ns["layernorm_dparams"], arrays="numba", seed=5, quiet=True),
          "last, partial chunk", "ceil(N / rows_per_chunk)")


def test_04_2_stage_two_overwriting_its_sum_is_named():
    ns = load(NB04, [("ex04-dparams-code", "total_w += dweight_part[k, c]", "total_w = dweight_part[k, c]"),
                     ("ex04-dparams-code", "total_b += dbias_part[k, c]", "total_b = dbias_part[k, c]")])
    wrong(check_layernorm_dparams(ns["layernorm_dparams"], arrays="numba", seed=5, quiet=True), "overwrites")


def test_04_2_stage_two_reading_only_the_first_chunk_is_named():
    ns = load(NB04, [("ex04-dparams-code", "for k in range(n_chunks):", "for k in range(1):")])
    wrong(check_layernorm_dparams(ns["layernorm_dparams"], arrays="numba", seed=5, quiet=True),
          "only the first chunk")


def test_04_2_chunks_that_overlap_by_a_row_are_named():
    ns = load(NB04, [("ex04-dparams-code", "range(first, min(N, first + ROWS_PER_CHUNK))",
                      "range(first, min(N, first + ROWS_PER_CHUNK + 1))")])
    wrong(check_layernorm_dparams(ns["layernorm_dparams"], arrays="numba", seed=5, quiet=True), "twice")


ROWS = 4 if SIM else 32


@cuda.jit
def _zero_vector(a):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = float32(0.0)


@cuda.jit
def _chunk_sums_atomic(dout, inp, mean, rstd, dweight, dbias):
    # stage 1 of the two stages, but adding each chunk's sums into the outputs with float atomics
    N, C = inp.shape
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c < C:
        w = float32(0.0)
        b = float32(0.0)
        first = cuda.blockIdx.y * ROWS
        for row in range(first, min(N, first + ROWS)):
            d = dout[row, c]
            b += d
            w += d * ((inp[row, c] - mean[row]) * rstd[row])
        cuda.atomic.add(dweight, c, w)
        cuda.atomic.add(dbias, c, b)


def _dparams_atomic(dout, inp, mean, rstd, dweight, dbias):
    N, C = inp.shape
    cols = (C + 31) // 32
    _zero_vector[cols, 32](dweight)
    _zero_vector[cols, 32](dbias)
    _chunk_sums_atomic[(cols, (N + ROWS - 1) // ROWS), 32](dout, inp, mean, rstd, dweight, dbias)


def test_04_2_float_atomics_fail_although_the_simulator_gives_the_same_bits():
    r = check_layernorm_dparams(_dparams_atomic, arrays="numba", seed=5, quiet=True)
    if SIM:
        wrong(r, "float atomics", "not deterministic")
    else:                       # on a GPU the bits usually change between the two calls; when they do not, it passes
        assert r.status in ("wrong", "correct")


def test_04_2_one_thread_per_column_is_the_lessons_v1_not_the_two_stages():
    ns = load(NB04)
    v1 = ns["layernorm_backward_v1_dparams"]

    def dparams_v1(dout, inp, mean, rstd, dweight, dbias):
        v1[(inp.shape[1] + 7) // 8, 8](dout, inp, mean, rstd, dweight, dbias)

    r = check_layernorm_dparams(dparams_v1, arrays="numba", seed=5, quiet=True)
    if SIM:
        wrong(r, "two-stage")
        assert "read 37 of the 37 rows of dout" in r.message
    else:
        assert r.status == "correct"


@sim_only
def test_04_2_an_order_that_changes_between_calls_fails_the_repeat():
    ns = load(NB04)
    calls = []

    def flaky(*args):                     # the chunk size (and so the float order) changes from call to call
        calls.append(1)
        ns["ROWS_PER_CHUNK"] = 3 if len(calls) % 2 else 4
        return ns["layernorm_dparams"](*args)

    r = check_layernorm_dparams(flaky, arrays="numba", seed=5, quiet=True)
    wrong(r, "order in which threads or blocks run")
    assert "two calls on the same inputs gave different bits" in r.message


def test_04_2_numpy_mistakes_are_named():
    def reference(dout, inp, mean, rstd, dweight, dbias, *, variant=None):
        xhat = (inp - mean[:, None]) * rstd[:, None]
        dweight[...] = (dout * (inp if variant == "inp" else xhat)).sum(axis=0)
        dbias[...] = dout.sum(axis=0)
        if variant == "swap":
            dweight[...], dbias[...] = dout.sum(axis=0), (dout * xhat).sum(axis=0)
        if variant == "suffix":
            dweight[...] = (dout * xhat)[-3:].sum(axis=0)

    assert check_layernorm_dparams(reference, seed=2, quiet=True).status == "correct"
    for variant, words in (("inp", ("dout * inp",)), ("swap", ("swapped",)), ("suffix", ("overwrites",))):
        wrong(check_layernorm_dparams(lambda *a, v=variant: reference(*a, variant=v), seed=2, quiet=True), *words)


# ------------------------------------------------------------------------------------------------------------
# 05.1 GELU backward with a grid-stride loop under a capped launcher (check_gelu_backward)
# ------------------------------------------------------------------------------------------------------------
def test_05_1_solution_passes_under_the_capped_launcher():
    ns = load(NB05)
    assert ns["MAX_BLOCKS"] * ns["THREADS"] == (1_048_576 if not SIM else 64)
    for seed in (1, 2):
        r = check_gelu_backward(ns["gelu_backward"], arrays="numba", seed=seed, quiet=True)
        assert r.status == "correct", r.message


def test_05_1_launcher_is_given_outside_the_solution_region():
    nb = nbformat.read(str(NB05), as_version=4)
    cell = next(c for c in nb.cells if c.id == "s05-07")
    given = cell.source.split("### END SOLUTION")[1]
    assert "launch_capped(gelu_backward_kernel" in given


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_05_1_one_element_per_thread_fails_past_the_grid(seed):
    ns = load(NB05, [("s05-07", "for i in range(first, dinp.shape[0], step):",
                      "for i in range(first, min(first + 1, dinp.shape[0])):")])
    r = check_gelu_backward(ns["gelu_backward"], arrays="numba", seed=seed, quiet=True)
    wrong(r, "grid")


# ------------------------------------------------------------------------------------------------------------
# 05.2 cross-entropy backward, one pass with the online (max, sum) merge (check_crossentropy_online)
# ------------------------------------------------------------------------------------------------------------
MERGE = "sh_sum[tid] = sh_sum[tid] * math.exp(m_lo - m_new) + sh_sum[tid + span] * math.exp(m_hi - m_new)"


def test_05_2_solution_passes():
    ns = load(NB05)
    r = check_crossentropy_online(ns["crossentropy_backward"], arrays="numba", seed=4, quiet=True)
    assert r.status == "correct", r.message


@pytest.mark.parametrize("edit, words", [
    ((MERGE, "sh_sum[tid] = sh_sum[tid] + sh_sum[tid + span]"), ("adds the two partial sums", "rescale")),
    ((MERGE, "sh_sum[tid] = sh_sum[tid] * math.exp(m_new - m_lo) + sh_sum[tid + span] * math.exp(m_new - m_hi)"),
     ("wrong sign",)),
    (("            sh_max[tid] = m_new\n", ""), ("merged max is not stored back",)),
    (("run_s = run_s * math.exp(run_m - x) + numba.float32(1.0)", "run_s = run_s + numba.float32(1.0)"),
     ("running max grows",)),
], ids=["merge-without-rescale", "rescale-wrong-sign", "max-not-merged", "update-without-rescale"])
def test_05_2_merge_mistakes_are_named(edit, words):
    ns = load(NB05, [("s05-03", *edit)])
    r = check_crossentropy_online(ns["crossentropy_backward"], arrays="numba", seed=4, quiet=True)
    wrong(r, *words)


def test_05_2_numpy_mistakes_are_named():
    def ce(logits, targets, dlogits, *, variant=None):
        x = logits.astype(np.float64 if variant != "nomax" else np.float32)      # float32, as a kernel computes
        m = x.max(axis=1, keepdims=True) if variant != "nomax" else np.float32(0.0)
        with np.errstate(all="ignore"):
            p = (np.exp(x - m) / np.exp(x - m).sum(axis=1, keepdims=True)).astype(np.float64)
        if variant != "target":
            p[np.arange(len(targets)), targets] -= 1.0
        dlogits[...] = p if variant == "mean" else p / len(targets)

    assert check_crossentropy_online(ce, seed=3, quiet=True).status == "correct"
    wrong(check_crossentropy_online(lambda *a: ce(*a, variant="target"), seed=3, quiet=True), "target")
    wrong(check_crossentropy_online(lambda *a: ce(*a, variant="mean"), seed=3, quiet=True), "divided by n")
    wrong(check_crossentropy_online(lambda *a: ce(*a, variant="nomax"), seed=3, quiet=True), "max")


def test_05_2_sizes_cover_several_blocks_an_empty_thread_and_overflow():
    c = checks_ops._make_ce(np.random.default_rng(0), np.dtype(np.float32), "small", 0)
    assert c.dims["V"] > 3 * 32
    assert checks_ops._make_ce(np.random.default_rng(0), np.dtype(np.float32), "small", 1).dims["V"] < 8
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.exp(c.inputs["logits"][0])).all()          # row 0 overflows without the max
    assert c.inputs["targets"][0] == 0 and c.inputs["targets"][-1] == c.dims["V"] - 1


# ------------------------------------------------------------------------------------------------------------
# 05.3 causal softmax backward inside attention (check_attention_softmax_backward)
# ------------------------------------------------------------------------------------------------------------
def test_05_3_solution_passes():
    ns = load(NB05)
    r = check_attention_softmax_backward(ns["attention_softmax_backward"], arrays="numba", seed=6, quiet=True)
    assert r.status == "correct", r.message


def test_05_3_mask_off_by_one_at_the_diagonal_is_named():
    ns = load(NB05, [("s05-att-code", "for s in range(lane, t + 1, ROW_THREADS):",
                      "for s in range(lane, t, ROW_THREADS):"),
                     ("s05-att-code", "if s <= t:", "if s < t:")])
    wrong(check_attention_softmax_backward(ns["attention_softmax_backward"], arrays="numba", seed=6, quiet=True),
          "off by one", "s < t")


def test_05_3_a_kernel_that_lost_the_head_index_is_named():
    # h = 0 for every row: each head's rows land in head 0's place, the other heads stay unwritten
    ns = load(NB05, [("s05-att-code", "    h = (row // T) % nh\n", "    h = 0\n")])
    wrong(check_attention_softmax_backward(ns["attention_softmax_backward"], arrays="numba", seed=6, quiet=True),
          "only head 0 of dpreatt was written", "head index h")


def test_05_3_a_row_longer_than_the_block_is_named():
    # each lane takes only entry s = lane: fine while T <= ROW_THREADS, wrong past the warp's edge (T = 33)
    ns = load(NB05, [("s05-att-code", "for s in range(lane, t + 1, ROW_THREADS):",
                      "for s in range(lane, min(t + 1, lane + 1)):"),
                     ("s05-att-code", "for s in range(lane, T, ROW_THREADS):", "for s in range(lane, min(T, lane + 1)):")])
    r = check_attention_softmax_backward(ns["attention_softmax_backward"], arrays="numba", seed=6, quiet=True)
    wrong(r, "larger than your block of 8 threads" if SIM else "larger than your block", "blockDim.x")
    assert r.dims["T"] > ns["ROW_THREADS"]


def _att_numpy(att, datt, dpreatt, hs, *, variant=None):
    B, nh, T, _ = att.shape
    a = att.astype(np.float64)
    causal = np.tril(np.ones((T, T), dtype=bool))
    t_row = np.arange(T)
    if variant == "layout":                      # rows numbered (b, t, h) while the arrays are (b, h, t)
        r = np.arange(B * nh * T).reshape(B, nh, T)
        t_row = (r // nh) % T
    mask = np.arange(T) <= t_row[..., None]
    if variant == "mask+1":
        mask = np.arange(T) <= t_row[..., None] + 1
    scale = {"noscale": 1.0, "twice": 1.0 / hs}.get(variant, 1.0 / np.sqrt(hs))
    am = np.where(mask, a, 0.0)
    dot = (am if variant != "wholerow" else a) * datt
    dot = dot.sum(-1, keepdims=True) if variant != "norowsum" else 0.0
    out = scale * a * (datt - dot)
    dpreatt[...] = out if variant == "fillabove" else np.where(mask, out, 0.0)
    if variant == "unwritten":
        dpreatt[..., ~causal] = np.nan
    if variant == "heads" and nh > 1:
        dpreatt[:, [1, 0]] = dpreatt[:, [0, 1]]


@pytest.mark.parametrize("variant, words", [
    ("mask+1", ("off by one", "t + 1")),
    ("wholerow", ("whole row", "masked entries")),
    ("fillabove", ("must be 0",)),
    ("noscale", ("scale is missing",)),
    ("twice", ("applied twice",)),
    ("norowsum", ("row-sum term",)),
    ("layout", ("wrong layout", "row % t")),
    ("unwritten", ("never written", "write 0")),
    ("heads", ("holds the values of", "(b * nh + h) * t + t")),
])
def test_05_3_numpy_mistakes_are_named(variant, words):
    assert check_attention_softmax_backward(_att_numpy, seed=8, quiet=True).status == "correct"
    wrong(check_attention_softmax_backward(lambda *a: _att_numpy(*a, variant=variant), seed=8, quiet=True), *words)


def test_05_3_sizes_cover_t_1_several_heads_and_a_row_past_any_block():
    dims = checks_ops._ATT_DIMS
    assert [T for _, _, T, _ in dims["small"]][:2] == [1, 7] and dims["small"][2][2] > 32
    assert dims["large"][2][2] > 1024
    assert any(B > 1 and nh > 1 for B, nh, _, _ in dims["small"])
    c = checks_ops._make_att_softmax(np.random.default_rng(0), np.dtype(np.float32), "small", 1)
    above = ~np.tril(np.ones((7, 7), dtype=bool))
    assert (c.inputs["att"][..., above] > 0).all()                     # garbage above the diagonal


# ------------------------------------------------------------------------------------------------------------
# 05.4 embedding backward with atomics (check_encoder_backward_atomic)
# ------------------------------------------------------------------------------------------------------------
def test_05_4_solution_passes():
    ns = load(NB05)
    r = check_encoder_backward_atomic(ns["encoder_backward"], arrays="numba", seed=7, quiet=True)
    assert r.status == "correct", r.message


def test_05_4_inputs_repeat_a_few_tokens_many_times_deterministically():
    for seed in range(5):
        c = checks_ops._make_encoder(np.random.default_rng(seed), np.dtype(np.float32), "small", 0)
        counts = c.x["counts"]
        V = c.dims["V"]
        assert counts[0] >= 4 and counts[V // 2] >= 4 and counts[V - 1] >= 4
        assert (counts == 0).any() and (counts == 1).sum() >= 1


def test_05_4_a_plain_add_is_a_race_even_where_the_simulator_gets_the_values_right():
    ns = load(NB05, [("s05-emb-code", "cuda.atomic.add(dwte, (idx[b, t], c), g)", "dwte[idx[b, t], c] += g"),
                     ("s05-emb-code", "cuda.atomic.add(dwpe, (t, c), g)", "dwpe[t, c] += g")])
    r = check_encoder_backward_atomic(ns["encoder_backward"], arrays="numba", seed=7, quiet=True)
    if SIM:                                       # right values by luck: the trace names the race
        wrong(r, "race", "cuda.atomic.add")
        assert "without atomics" in r.message
    else:                                         # on a GPU the updates are lost: the values name the fix
        wrong(r, "several times", "cuda.atomic.add")


def test_05_4_forgetting_to_zero_is_named():
    ns = load(NB05, [("s05-emb-code", "    launch_capped(zero_rows, dwte.shape[0] * dwte.shape[1], dwte)\n", ""),
                     ("s05-emb-code", "    launch_capped(zero_rows, dwpe.shape[0] * dwpe.shape[1], dwpe)\n", "")])
    wrong(check_encoder_backward_atomic(ns["encoder_backward"], arrays="numba", seed=7, quiet=True), "to 0 first")


def test_05_4_no_grid_stride_loop_under_the_capped_launcher_fails():
    ns = load(NB05, [("s05-emb-code", "for i in range(cuda.grid(1), B * T * C, cuda.gridsize(1)):",
                      "for i in range(cuda.grid(1), min(B * T * C, cuda.grid(1) + 1)):")])
    r = check_encoder_backward_atomic(ns["encoder_backward"], arrays="numba", seed=7, quiet=True)
    assert r.status == "wrong", r.message


# ------------------------------------------------------------------------------------------------------------
# 05.5 deterministic embedding backward (check_encoder_backward_deterministic)
# ------------------------------------------------------------------------------------------------------------
def test_05_5_solution_passes_with_the_contracts_bits():
    ns = load(NB05)
    r = check_encoder_backward_deterministic(ns["encoder_backward_det"], arrays="numba", seed=9, quiet=True)
    assert r.status == "correct", r.message
    assert "bits of the fixed order" in r.message and "same bits twice" in r.message


def test_05_5_the_atomic_version_fails():
    ns = load(NB05)
    r = check_encoder_backward_deterministic(ns["encoder_backward"], arrays="numba", seed=9, quiet=True)
    if SIM:                                      # the simulator's atomics land in order: caught by the trace
        wrong(r, "float atomics")
    else:                                        # on a GPU: other bits than the contract's order, or than run 1
        assert r.status == "wrong", r.message


def test_05_5_a_different_fixed_order_is_named():
    ns = load(NB05, [("s05-det-code", "for k in range(starts[v], starts[v + 1]):",
                      "for k in range(starts[v + 1] - 1, starts[v] - 1, -1):")])
    r = check_encoder_backward_deterministic(ns["encoder_backward_det"], arrays="numba", seed=9, quiet=True)
    wrong(r, "contract fixes the order", "increasing p")


def test_05_5_state_kept_from_the_first_call_fails_on_the_second():
    ns = load(NB05, [("s05-det-code", "    V = dwte.shape[0]\n    flat = idx.copy_to_host().ravel()\n",
                      "    V = dwte.shape[0]\n    flat = CACHE.setdefault('idx', idx.copy_to_host().ravel())\n")])
    ns["CACHE"] = {}
    r = check_encoder_backward_deterministic(ns["encoder_backward_det"], arrays="numba", seed=9, quiet=True)
    assert r.status in ("wrong", "error"), r.message


def test_fixed_order_helper_is_the_sequential_float32_sum():
    rng = np.random.default_rng(0)
    dout = rng.standard_normal((2, 3, 4)).astype(np.float32)
    idx = np.array([[1, 0, 1], [1, 2, 0]], dtype=np.int32)
    dwte, dwpe = checks_ops.encoder_fixed_order(dout, idx, V=4, maxT=5)
    p = dout.reshape(6, 4)
    assert np.array_equal(dwte[1], ((np.float32(0) + p[0]) + p[2]) + p[3])
    assert np.array_equal(dwte[3], np.zeros(4, np.float32)) and np.array_equal(dwpe[3:], np.zeros((2, 4)))
    assert np.array_equal(dwpe[:3], (np.float32(0) + dout[0]) + dout[1])


# ------------------------------------------------------------------------------------------------------------
# The checkers' own contract
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checker", [check_layernorm_dparams, check_crossentropy_online,
                                     check_attention_softmax_backward, check_encoder_backward_atomic,
                                     check_encoder_backward_deterministic])
def test_checkers_name_bad_input_and_report_not_attempted(checker):
    with pytest.raises(TypeError, match="must be your function"):
        checker(np.zeros(3))

    def todo(*args):
        raise NotImplementedError

    r = checker(todo, seed=1, task="xx.1 test", quiet=True)
    assert r.status == "not attempted" and r.task == "xx.1 test"
    if not device.has_gpu():
        assert checker(todo, arrays="cupy", quiet=True).status == "skipped"


def test_fresh_exercises_are_not_attempted_also_where_a_kernel_raise_would_be_compiled_away():
    # on a GPU an untouched kernel stub does not raise (the raise is compiled away), so the checkers look for it
    ex04 = load(ROOT / "exercises" / "04_layernorm_backward.ipynb")
    ex05 = load(ROOT / "exercises" / "05_gelu_attention_cross_entropy.ipynb")
    calls = [(check_layernorm_dparams, ex04["layernorm_dparams"]),
             (check_crossentropy_online, ex05["crossentropy_backward"]),
             (check_attention_softmax_backward, ex05["attention_softmax_backward"]),
             (check_encoder_backward_atomic, ex05["encoder_backward"]),
             (check_encoder_backward_deterministic, ex05["encoder_backward_det"])]
    for checker, fn in calls:
        r = checker(fn, arrays="numba", seed=1, quiet=True)
        assert r.status == "not attempted", r.message
    assert checks_ops.unfinished_kernel(ex05["attention_softmax_backward"]) == "attention_softmax_backward_kernel"
    assert checks_ops.unfinished_kernel(ex05["gelu_backward"]) == "gelu_backward_kernel"
    assert checks_ops.unfinished_kernel(ex04["layernorm_backward"]) == "ln_backward_dinp"
    assert checks_ops.unfinished_kernel(load(NB05)["attention_softmax_backward"]) is None
    from gpullm_lessons.classroom.exercises import RAISE_LINE
    assert checks_ops.STUB == RAISE_LINE


# ------------------------------------------------------------------------------------------------------------
# On a GPU: GPU sizes, and the nondeterminism the simulator cannot show
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_solutions_pass_at_gpu_sizes():
    if not device.numba_on_gpu():
        pytest.skip("Numba kernels run on NVIDIA GPUs only")
    ns4, ns5 = load(NB04), load(NB05)
    for checker, fn in ((check_layernorm_backward, ns4["layernorm_backward"]),
                        (check_layernorm_dparams, ns4["layernorm_dparams"]),
                        (check_gelu_backward, ns5["gelu_backward"]),
                        (check_crossentropy_online, ns5["crossentropy_backward"]),
                        (check_attention_softmax_backward, ns5["attention_softmax_backward"]),
                        (check_encoder_backward_atomic, ns5["encoder_backward"]),
                        (check_encoder_backward_deterministic, ns5["encoder_backward_det"])):
        for size in ("small", "large"):
            r = checker(fn, arrays="numba", size=size, seed=1, quiet=True)
            assert r.status == "correct", r.message


@pytest.mark.gpu
def test_gpu_plain_adds_lose_updates_and_atomics_change_bits():
    if not device.numba_on_gpu():
        pytest.skip("Numba kernels run on NVIDIA GPUs only")
    racy = load(NB05, [("s05-emb-code", "cuda.atomic.add(dwte, (idx[b, t], c), g)", "dwte[idx[b, t], c] += g"),
                       ("s05-emb-code", "cuda.atomic.add(dwpe, (t, c), g)", "dwpe[t, c] += g")])
    wrong(check_encoder_backward_atomic(racy["encoder_backward"], arrays="numba", size="large", seed=1, quiet=True),
          "atomic")
    ns = load(NB05)
    r = check_encoder_backward_deterministic(ns["encoder_backward"], arrays="numba", size="large", seed=1, quiet=True)
    assert r.status == "wrong", r.message
