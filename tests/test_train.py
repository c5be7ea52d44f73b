"""The training job (NumPy backend): a short run in-process, its outputs, and the configuration errors."""
import json
import math

import numpy as np
import pytest

from gpullm_lessons import train
from gpullm_lessons.params import GPTConfig, init_params

LOG_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # the tiny model; batch 8 (not 16) keeps the test quick
    summary = train.main(["--steps", "30", "--batch-size", "8", "--eval-every", "10", "--eval-batches", "4",
                          "--sample-tokens", "40",
                          "--lr", "3e-3", "--warmup", "3", "--out", str(out), "--no-progress"])
    return out, summary


def test_loss_falls(run):
    _, s = run
    assert s["train_loss_first"] == pytest.approx(math.log(256), abs=0.3)  # random init: ~uniform over bytes
    assert s["train_loss_last"] < s["train_loss_first"] - 1.0
    assert s["val_loss"] < s["val_loss_init"] - 1.0
    assert 2.5 < s["unigram_entropy"] < math.log(256)
    assert s["steps"] == 30 and s["backend"] == "numpy" and s["time_s"] > 0


def test_log_jsonl(run):
    out, s = run
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(records) == 30
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        assert LOG_KEYS <= set(r) <= LOG_KEYS | {"val_loss"}
        assert all(math.isfinite(r[k]) for k in r)
    evaluated = [r["step"] for r in records if "val_loss" in r]
    assert evaluated == [10, 20, 30]
    assert records[-1]["val_loss"] == pytest.approx(s["val_loss"])
    assert records[0]["lr"] == pytest.approx(3e-3 / 3)  # warmup
    assert records[-1]["lr"] == pytest.approx(3e-4)  # min_lr = lr / 10 at the last step


def test_outputs_written(run):
    out, _ = run
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    sample = (out / "sample.txt").read_text(encoding="utf-8")
    assert len(sample.encode("utf-8", errors="replace")) >= 20
    assert json.loads((out / "config.json").read_text())["steps"] == 30


def test_summary_line_printed(tmp_path, capsys):
    train.main(["--steps", "2", "--eval-batches", "1", "--sample-tokens", "0", "--out", str(tmp_path),
                "--no-progress"])
    text = capsys.readouterr().out
    assert "done: 2 steps" in text and "byte-unigram entropy" in text and "val loss" in text
    assert not (tmp_path / "sample.txt").exists()


def test_generate_reproducible_and_greedy():
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, d_model=16)
    params = init_params(cfg, seed=0)
    a = train.generate(params, cfg, "ab", 12, temperature=1.0, top_k=5, rng=np.random.default_rng(0))
    b = train.generate(params, cfg, "ab", 12, temperature=1.0, top_k=5, rng=np.random.default_rng(0))
    assert a.dtype == np.int32 and len(a) == 14 and list(a[:2]) == [97, 98]
    assert np.array_equal(a, b)
    g = train.generate(params, cfg, np.array([1, 2, 3]), 10, temperature=0)  # longer than block_size: cropped
    assert len(g) == 13 and g.max() < 256
    with pytest.raises(ValueError, match="prompt"):
        train.generate(params, cfg, "", 3)


def test_d_model_not_divisible(tmp_path):
    with pytest.raises(ValueError, match="d_model 65 is not divisible by n_head 2"):
        train.main(["--d-model", "65", "--out", str(tmp_path)])


def test_block_size_too_long_for_data(tmp_path):
    data = tmp_path / "small.txt"
    data.write_bytes(b"hello world\n" * 50)  # 600 bytes: block size 64 needs 641
    with pytest.raises(ValueError, match="has 600 bytes.*641"):
        train.main(["--data", str(data), "--out", str(tmp_path / "o")])


def test_data_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        train.main(["--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")])
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        train.main(["--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")])


def test_custom_data_trains(tmp_path):
    data = tmp_path / "abc.txt"
    data.write_bytes(b"abcabcabd" * 200)
    s = train.main(["--data", str(data), "--block-size", "16", "--steps", "5", "--eval-batches", "1",
                    "--sample-tokens", "0", "--out", str(tmp_path / "o"), "--no-progress"])
    assert s["steps"] == 5


@pytest.mark.parametrize("backend", ["numba", "hip"])
def test_future_backend(tmp_path, backend):
    with pytest.raises(ValueError, match=f"backend '{backend}' arrives in lesson 09.*--backend numpy"):
        train.main(["--backend", backend, "--out", str(tmp_path)])


def test_unknown_backend(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--backend", "tpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'tpu'" in err and "numpy" in err and "hip" in err


def test_cli_prints_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.cli(["--data", str(tmp_path / "missing.txt")])
    assert e.value.code == 2
    assert "error: data file not found" in capsys.readouterr().err


def test_presets():
    assert train.PRESETS["tiny"] == dict(n_layer=2, n_head=2, d_model=64, block_size=64, vocab_size=256,
                                         batch_size=16, lr=1e-3)
    c = train.PRESETS["course"]
    assert (c["n_layer"], c["n_head"], c["d_model"], c["block_size"]) == (6, 6, 384, 256)
    g = train.PRESETS["gpt2"]
    assert (g["n_layer"], g["n_head"], g["d_model"], g["block_size"], g["vocab_size"]) == (12, 12, 768, 1024, 50304)
