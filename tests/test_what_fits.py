"""The "what fits" table (bench_train.what_fits / largest_layers): the most layers whose engine_memory prediction
fits a memory budget, found by bisection, checked against the model itself without a GPU."""

import pytest
from pathlib import Path

from gpullm_lessons.bench import kernels as bench, train_step as bt
from gpullm_lessons.engine import engine_memory
from gpullm_lessons.model.params import GPTConfig

GIB = 2**30


def _need(C, T, B, L, policy="none", attention="flash"):
    cfg = GPTConfig(vocab_size=50257, block_size=T, n_layer=L, n_head=C // 64, d_model=C)
    return engine_memory(cfg, B, T, "bf16", policy, attention=attention)["total"]


@pytest.mark.parametrize(
    "C, T, policy, attention",
    [(768, 1024, "none", "cublas"), (1024, 4096, "none", "flash"), (1600, 4096, "selective", "flash")],
)
def test_largest_layers_is_the_edge_of_the_prediction(C, T, policy, attention):
    budget = 40 * GIB
    L, need = bt.largest_layers(C, T, 4, budget, policy=policy, attention=attention)
    assert L >= 1 and need == _need(C, T, 4, L, policy, attention) <= budget
    assert _need(C, T, 4, L + 1, policy, attention) > budget  # one layer more does not fit: the edge, not below it


def test_flash_and_checkpointing_fit_more_layers_and_nothing_fits_a_tiny_budget():
    rows = bt.what_fits(40 * GIB, widths=(1024,), contexts=(4096,), B=4)
    layers = {(r["attention"], r["policy"]): r["layers"] for r in rows}
    assert layers["cublas", "none"] < layers["flash", "none"] < layers["flash", "selective"] <= layers["flash", "full"]
    assert bt.largest_layers(1024, 4096, 4, 1 * GIB)[0] == 0
    with pytest.raises(ValueError, match="not a multiple of the head size 64"):
        bt.largest_layers(1000, 1024, 4, 40 * GIB)


def test_kernel_row_picks_the_fastest_error_free_row_of_an_op_backend_and_version():
    rows = [
        {"op": "f", "backend": "hip", "version": "v2", "ms": 2.0},
        {"op": "f", "backend": "hip", "version": "v3", "ms": 1.0},
        {"op": "f", "backend": "hip", "version": "v4", "error": "boom"},
        {"op": "g", "backend": "hip", "version": "v2", "ms": 0.5},
        {"op": "f", "backend": "torch", "version": "2.11", "ms": 0.3},
    ]
    result = {"rows": rows}
    assert bench.kernel_row(result, "f", "hip")["version"] == "v3"
    assert bench.kernel_row(result, "f", "hip", "v2")["ms"] == 2.0
    assert bench.kernel_row(result, "f", "hip", "v4") is None  # only an error row
    assert bench.kernel_row(result, "f", "torch")["ms"] == 0.3
    assert bench.kernel_row(result, "h", "hip") is None


def test_version_table_lists_the_versions_and_compares_two_with_pytorch():
    def row(version, ms, backend="hip"):
        return {"op": "f", "backend": backend, "version": version, "ms": ms, "TFLOP/s": 100 / ms,
                "fraction_of_ceiling": 0.1 / ms}

    result = {"card": "a card", "date": "d", "ceilings": {"matmul_bf16": {"TFLOP/s": 800.0}},
              "rows": [row("v3", 0.4), row("v4", 0.2), row("2.11", 0.05, "torch")]}
    text = bench.format_version_table(result, ["f"], ("v3", "v4", "v5"), "v3", "v4")
    lines = text.splitlines()
    assert "bf16 matmul rate 800 TFLOP/s" in lines[0] and "the course's stored run on a card, d" in lines[0]
    assert [ln.split()[1] for ln in lines[2:5]] == ["v3", "v4", "PyTorch"]  # v5 has no row: left out
    assert "f: v3 -> v4 2.00x faster; v4 takes 4.00x PyTorch's time" in text
    # no comparison line when one side is missing
    assert "faster" not in bench.format_version_table(result, ["f"], ("v3", "v4"), "v4", "v5")


def test_run_metadata_names_the_command_and_the_flash_version_of_step_runs():
    """A stored result says how it was made: the command without --json and its path, and for the training-step runs
    (flash attention by default) the flash version the engine's packed launchers ran; not for a cuBLAS-path run."""
    from gpullm_lessons.backends.hip import flash

    meta = bench.run_metadata("gputime", ["gputime", "--presets", "gpt2", "--json", "x.json"])
    commit = {"commit": meta["commit"], "dirty": meta["dirty"]}  # the checkout's, as make gpu-test records it
    assert meta == {
        "command": "python -m gpullm_lessons.bench gputime --presets gpt2",
        **commit,
        "flash_version": flash.DEFAULT,
        "flash_layout": "packed",
    }
    for flag in (["--flash-version", "v4"], ["--flash-version=v4"]):  # the version asked for, not the default
        meta = bench.run_metadata("train", ["train", *flag, "--compile", "--json", "z.json"])
        assert meta["flash_version"] == "v4" != flash.DEFAULT and meta["command"].endswith("v4 --compile"), meta
    meta = bench.run_metadata("train", ["train", "--json=y.json", "--attention", "cublas", "--compile"])
    assert meta == {"command": "python -m gpullm_lessons.bench train --attention cublas --compile", **commit}
    assert bench.run_metadata("kernels", ["kernels", "--ops", "flash_fwd_bf16"]) == {
        "command": "python -m gpullm_lessons.bench kernels --ops flash_fwd_bf16", **commit
    }


def test_run_metadata_records_the_commit_measured(monkeypatch):
    """The commit of the checkout (git), or GPULLM_COMMIT / GPULLM_DIRTY where the tree has no history (a lent
    machine's copy, a container), as make gpu-test records them."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(bench.__file__).parents[2], capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.delenv("GPULLM_COMMIT", raising=False)
    if head:
        assert bench.run_metadata("ceilings", ["ceilings"])["commit"] == head
    monkeypatch.setenv("GPULLM_COMMIT", "a" * 40)
    monkeypatch.setenv("GPULLM_DIRTY", "1")
    meta = bench.run_metadata("ceilings", ["ceilings"])
    assert meta["commit"] == "a" * 40 and meta["dirty"] is True
