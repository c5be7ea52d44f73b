"""bench train --variant: our engine measured once per variant beside one PyTorch measurement per configuration.

The GPU paths cannot run here: measure_engine, measure_torch, the NumPy reference step and the matmul rate are
stand-ins that record what they were asked for, so the tests check what bench_train asks for and what it stores."""

import json
import sys
import types

import pytest

from gpullm_lessons import device
from gpullm_lessons.bench import kernels as cli
from gpullm_lessons.bench import timing
from gpullm_lessons.bench import train_step as bt
from gpullm_lessons.engine import EngineError


@pytest.fixture
def calls(monkeypatch):
    """Stand-ins; returns the list of (who, versions, ce_chunks, graphs) asked for."""
    asked = []

    def engine(cfg, B, T, prec, backend="hip", steps=10, versions=None, graphs="off", reference=None, ce_chunks=1):
        asked.append(("ours", dict(versions or {}), ce_chunks, graphs))
        if (versions or {}).get("flash") == "v9":
            raise EngineError("versions: flash must be one of v4, v5, v6, v7, got 'v9'")
        ms = 10.0 + len(asked)  # a different time per call: a row shows its own measurement
        return {"step_ms": ms, "peak_bytes": 2**30, "status": "ok", "validation": {"ok": True, "max_err": 1e-4}}

    def torch(cfg, B, T, prec, steps=10, compile=False):
        asked.append(("torch.compile" if compile else "pytorch", None, None, None))
        return {"step_ms": 20.0, "peak_bytes": 2**30, "version": "2.x"}

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # bench_train checks that it imports
    monkeypatch.setattr(bt, "measure_engine", engine)
    monkeypatch.setattr(bt, "measure_torch", torch)
    monkeypatch.setattr(bt, "first_step_reference", lambda cfg, x, y: {"loss": 1.0})
    monkeypatch.setattr(bt, "_card", lambda: "stand-in card")
    monkeypatch.setattr(device, "require_gpu", lambda why=None: None)
    monkeypatch.setattr(timing, "matmul_rate", lambda dtype="float32", n=8192: {"TFLOP/s": 100.0})
    return asked


def test_each_variant_runs_our_engine_with_its_versions_and_pytorch_once(calls):
    variants = [("scores", {"attention": "cublas"}), ("v4", {"flash": "v4", "ce_chunks": 4}), ("v6", {})]
    r = bt.bench_train(("course",), ("bf16",), versions={"gelu_in": "half"}, with_compile=True, ce_chunks=8,
                       variants=variants)
    ours = [c for c in calls if c[0] == "ours"]
    assert ours == [("ours", {"gelu_in": "half", "attention": "cublas"}, 8, "off"),
                    ("ours", {"gelu_in": "half", "attention": "cublas"}, 8, "on"),
                    ("ours", {"gelu_in": "half", "flash": "v4"}, 4, "off"),
                    ("ours", {"gelu_in": "half", "flash": "v4"}, 4, "on"),
                    ("ours", {"gelu_in": "half"}, 8, "off"),
                    ("ours", {"gelu_in": "half"}, 8, "on")]
    assert [c[0] for c in calls if c[0] != "ours"] == ["pytorch", "torch.compile"]  # once for all variants
    rows = r["rows"]
    assert [(x["who"], x.get("variant")) for x in rows] == [
        ("ours", "scores"), ("ours+graph", "scores"), ("ours", "v4"), ("ours+graph", "v4"), ("ours", "v6"),
        ("ours+graph", "v6"), ("pytorch", None), ("torch.compile", None)]
    assert [x["step_ms"] for x in rows[:6]] == [11.0, 12.0, 13.0, 14.0, 15.0, 16.0]  # each its own measurement
    assert r["variants"]["v4"] == {"versions": {"gelu_in": "half", "flash": "v4"}, "ce_chunks": 4}
    assert r["variants"]["v6"] == {"versions": {"gelu_in": "half"}, "ce_chunks": 8}
    text = bt.format_train(r)
    assert "ours+graph [v4]" in text and "[v4]: gelu_in half, flash v4, ce_chunks 4" in text
    json.dumps(r)  # stored as JSON


def test_without_variants_the_result_is_as_before(calls):
    r = bt.bench_train(("course",), ("bf16",), versions={"flash": "v5"})
    assert "variants" not in r and not any("variant" in x for x in r["rows"])
    assert [c[1] for c in calls if c[0] == "ours"] == [{"flash": "v5"}, {"flash": "v5"}]


def test_a_variant_that_cannot_run_is_a_row_with_its_error_and_the_others_run(calls):
    r = bt.bench_train(("course",), ("bf16",), variants=[("bad", {"flash": "v9"}), ("v6", {})], with_torch=False)
    bad = [x for x in r["rows"] if x.get("variant") == "bad"]
    assert len(bad) == 1 and "step_ms" not in bad[0] and "flash must be one of" in bad[0]["error"]
    assert bad[0]["status"] == "error" and not cli.unvalidated_rows({"rows": bad})  # says why it has no time
    assert [x["who"] for x in r["rows"] if x.get("variant") == "v6"] == ["ours", "ours+graph"]
    assert "flash must be one of" in bt.format_train(r)


def test_without_variants_an_engine_error_still_stops_the_run(calls):
    with pytest.raises(EngineError, match="flash must be one of"):
        bt.bench_train(("course",), ("bf16",), versions={"flash": "v9"}, with_torch=False)


@pytest.mark.parametrize("argv,said", [
    (["train", "--variant", "v4"], "LABEL:key=value"),
    (["train", "--variant", "x:flsh=v4"], "'flsh' is not an engine version"),
    (["train", "--variant", "x:ce_chunks=two"], "ce_chunks must be a positive integer"),
    (["train", "--variant", "a:flash=v4", "--variant", "a:flash=v5"], "its own label"),
    (["gputime", "--variant", "a:flash=v4"], "--variant goes with `train`"),
])
def test_bad_variants_are_refused_by_name_before_anything_runs(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_the_command_line_passes_the_variants_and_stores_them(calls, tmp_path):
    out = tmp_path / "r.json"
    assert cli.main(["train", "--presets", "course", "--precisions", "bf16", "--ce-chunks", "8", "--variant",
                     "scores:attention=cublas", "--variant", "c4:ce_chunks=4", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["variants"] == {"scores": {"versions": {"attention": "cublas"}, "ce_chunks": 8},
                             "c4": {"versions": {}, "ce_chunks": 4}}
    assert "flash_version" not in r  # the versions are per variant
    assert "--variant scores:attention=cublas" in r["command"]
