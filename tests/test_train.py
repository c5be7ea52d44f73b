"""The training job: a short run in-process, its outputs, the engine against the reference loop, checkpoint and
resume, the numba backend in the simulator, and the configuration errors (each before any training)."""
import json
import math
import re

import numpy as np
import pytest

from gpullm_lessons import engine, train
from gpullm_lessons.model.params import GPTConfig

LOG_KEYS = {"step", "loss", "lr", "grad_norm", "skipped", "tokens_per_s"}
# a toy model and batch for the tests that compare runs (the tiny preset's own shape is exercised by `run`)
TOY = ["--backend", "numpy", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--block-size", "16",
       "--batch-size", "4", "--eval-batches", "1", "--sample-tokens", "0", "--lr", "3e-3", "--no-progress"]


def log_of(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # the tiny model; batch 8 (not 16) keeps the test quick
    summary = train.main(["--backend", "numpy", "--steps", "30", "--batch-size", "8", "--eval-every", "10",
                          "--eval-batches", "4", "--sample-tokens", "40",
                          "--lr", "3e-3", "--warmup", "3", "--out", str(out), "--no-progress"])
    return out, summary


def test_loss_falls(run):
    _, s = run
    assert s["train_loss_first"] == pytest.approx(math.log(256), abs=0.3)  # random init: ~uniform over bytes
    assert s["train_loss_last"] < s["train_loss_first"] - 1.0
    assert s["val_loss"] < s["val_loss_init"] - 1.0
    assert 2.5 < s["unigram_entropy"] < math.log(256)
    assert s["steps"] == 30 and s["backend"] == "numpy" and s["time_s"] > 0
    assert s["skipped_steps"] == 0 and s["resumed_from_step"] is None


def test_log_jsonl(run):
    out, s = run
    records = log_of(out)
    assert len(records) == 30
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        assert LOG_KEYS <= set(r) <= LOG_KEYS | {"val_loss"}  # no "scale": fp32 has no loss scaler
        assert r["skipped"] is False
        assert all(math.isfinite(r[k]) for k in r if k != "skipped")
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
    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 30 and config["backend"] == "numpy" and config["precision"] == "fp32"
    ckpt = train.load_checkpoint(out / "ckpt.npz")
    assert ckpt["progress"]["step"] == 30 and ckpt["engine"]["t"] == 30
    assert ckpt["config"]["model"]["d_model"] == 64 and ckpt["config"]["batch_size"] == 8
    assert not (out / "ckpt.npz.tmp").exists()


def test_default_out_names_the_resolved_backend(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    s = train.main(TOY[2:] + ["--steps", "1"])  # no --backend: auto
    resolved = engine.check_backend("auto")  # numpy here; hip on a GPU machine
    assert s["backend"] == resolved and s["out"] == f"runs/tiny-{resolved}"
    assert (tmp_path / "runs" / f"tiny-{resolved}" / "log.jsonl").exists()
    text = capsys.readouterr().out
    assert "done: 1 steps" in text and "byte-unigram entropy" in text and "val loss" in text
    assert "[--backend auto]" in text
    assert not (tmp_path / "runs" / f"tiny-{resolved}" / "sample.txt").exists()


# -----------------------------------------------------------------------------
# the engine's numpy backend is the reference loop of the first version of this script, bit for bit

@pytest.mark.parametrize("policy", ["none", "full"])
def test_numpy_engine_equals_reference_loop(tmp_path, policy):
    from gpullm_lessons.data import BatchSampler, load_corpus
    from gpullm_lessons.model.optim import AdamW, clip_grad_norm, decay_mask_for, lr_schedule
    from gpullm_lessons.model.params import ParamBuffer, init_params
    from gpullm_lessons.reference import gpt_backward, gpt_forward

    steps, lr, warmup, min_lr = 4, 3e-3, 1, 3e-4
    train.main(TOY + ["--steps", str(steps), "--warmup", str(warmup), "--checkpointing", policy,
                      "--out", str(tmp_path)])
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, d_model=32)
    sampler = BatchSampler(load_corpus(None, 16).train, 4, 16, seed=0)
    params = init_params(cfg, seed=0, dtype=np.float32)
    grads = ParamBuffer(cfg, dtype=np.float32)
    opt = AdamW(params.flat, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay_mask=decay_mask_for(cfg))
    losses = []
    for step in range(1, steps + 1):
        x, y = next(sampler)
        _, loss, cache = gpt_forward(params.views, cfg, x, y)
        gpt_backward(cache, grads.views)
        clip_grad_norm(grads.flat, 1.0)
        opt.step(grads.flat, lr=lr_schedule(step - 1, lr, warmup, steps, min_lr))
        losses.append(float(loss))
    assert [r["loss"] for r in log_of(tmp_path)] == losses  # exactly
    assert np.array_equal(train.load_checkpoint(tmp_path / "ckpt.npz")["engine"]["params"], params.flat)


# -----------------------------------------------------------------------------
# checkpoint and resume

class Crash(Exception):
    """Stands in for a killed process."""


def test_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    args = TOY + ["--steps", "6", "--eval-every", "2"]
    straight = tmp_path / "straight"
    train.main(args + ["--out", str(straight)])

    # the same run, killed during step 5; its last checkpoint is the one of step 3
    build = engine.build

    def crashing_build(*a, **k):
        eng = build(*a, **k)
        step = eng.train_step

        def train_step(*a, **k):
            if eng.t == 4:
                raise Crash()
            return step(*a, **k)

        eng.train_step = train_step
        return eng

    resumed = tmp_path / "resumed"
    monkeypatch.setattr(engine, "build", crashing_build)
    with pytest.raises(Crash):
        train.main(args + ["--checkpoint-every", "3", "--out", str(resumed)])
    monkeypatch.setattr(engine, "build", build)
    assert [r["step"] for r in log_of(resumed)] == [1, 2, 3, 4]
    assert train.load_checkpoint(resumed / "ckpt.npz")["progress"]["step"] == 3

    s = train.main(args + ["--checkpoint-every", "3", "--out", str(resumed), "--resume"])
    assert s["resumed_from_step"] == 3
    a, b = log_of(straight), log_of(resumed)
    assert [r["step"] for r in b] == list(range(1, 7))  # the records of steps 1-3 kept, step 4 logged once
    assert [r["loss"] for r in b] == [r["loss"] for r in a]  # exactly: steps 4-6 continue the same run
    assert [r.get("val_loss") for r in b] == [r.get("val_loss") for r in a]
    sa, sb = (train.load_checkpoint(d / "ckpt.npz") for d in (straight, resumed))
    for key in ("params", "m", "v"):
        assert np.array_equal(sa["engine"][key], sb["engine"][key])
    assert sa["progress"]["sampler"] == sb["progress"]["sampler"]
    assert not (resumed / "ckpt.npz.tmp").exists()


def test_resume_refuses_another_config(tmp_path, capsys):
    train.main(TOY + ["--steps", "2", "--out", str(tmp_path)])
    log = (tmp_path / "log.jsonl").read_text()
    ckpt = tmp_path / "ckpt.npz"
    for flags, message in ((["--d-model", "64"], "d_model 32 != 64"), (["--n-layer", "2"], "n_layer 1 != 2"),
                           (["--batch-size", "8"], "batch_size 4 != 8"),
                           (["--block-size", "32"], "block_size 16 != 32")):
        with pytest.raises(train.ConfigError,
                           match=re.escape(f"checkpoint {ckpt} is from a different config: {message}")):
            train.main(TOY + ["--steps", "4", "--out", str(tmp_path), "--resume"] + flags)
    with pytest.raises(train.ConfigError, match="at step 2 and --steps is 2: nothing left to train"):
        train.main(TOY + ["--steps", "2", "--out", str(tmp_path), "--resume"])
    assert (tmp_path / "log.jsonl").read_text() == log  # nothing trained, nothing logged
    # a longer run from the end of this one: the schedule change is reported
    capsys.readouterr()
    s = train.main(TOY + ["--steps", "3", "--out", str(tmp_path), "--resume"])
    assert s["resumed_from_step"] == 2 and [r["step"] for r in log_of(tmp_path)] == [1, 2, 3]
    assert "steps 2 != 3" in capsys.readouterr().out


def test_resume_without_or_with_a_broken_checkpoint(tmp_path):
    with pytest.raises(train.ConfigError, match=re.escape(f"--resume: no checkpoint at {tmp_path / 'ckpt.npz'}")):
        train.main(TOY + ["--out", str(tmp_path), "--resume"])
    (tmp_path / "ckpt.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(train.ConfigError, match="ckpt.npz cannot be read"):
        train.main(TOY + ["--out", str(tmp_path), "--resume"])
    assert not (tmp_path / "log.jsonl").exists()


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, d_model=16)
    eng = engine.build(cfg, "numpy")
    path = tmp_path / "ckpt.npz"
    train.save_checkpoint(path, eng, {"model": {}}, {"step": 1})
    before = path.read_bytes()

    def savez_then_die(f, **arrays):
        f.write(b"half a checkpoint")
        raise Crash()

    monkeypatch.setattr(np, "savez", savez_then_die)
    with pytest.raises(Crash):
        train.save_checkpoint(path, eng, {"model": {}}, {"step": 2})
    assert path.read_bytes() == before and not (tmp_path / "ckpt.npz.tmp").exists()
    assert train.load_checkpoint(path)["progress"] == {"step": 1}


# -----------------------------------------------------------------------------
# the numba backend (in the CUDA simulator without a GPU: ~2 s a step at this size)

def test_numba_backend_matches_numpy(tmp_path):
    toy = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--block-size", "8", "--batch-size", "2",
           "--steps", "2", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
    a = train.main(toy + ["--backend", "numpy", "--out", str(tmp_path / "numpy")])
    b = train.main(toy + ["--backend", "numba", "--out", str(tmp_path / "numba")])
    assert b["backend"] == "numba" and b["out"] == str(tmp_path / "numba")
    assert b["train_loss_first"] == pytest.approx(a["train_loss_first"], rel=1e-4)
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-3)
    assert [r["skipped"] for r in log_of(tmp_path / "numba")] == [False, False]


# -----------------------------------------------------------------------------
# generation

def test_generate_reproducible_and_greedy():
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, d_model=16)
    eng = engine.build(cfg, "numpy")
    a = train.generate(eng.next_logits, 8, "ab", 12, temperature=1.0, top_k=5, rng=np.random.default_rng(0))
    b = train.generate(eng.next_logits, 8, "ab", 12, temperature=1.0, top_k=5, rng=np.random.default_rng(0))
    assert a.dtype == np.int32 and len(a) == 14 and list(a[:2]) == [97, 98]
    assert np.array_equal(a, b)
    g = train.generate(eng.next_logits, 8, np.arange(1, 12), 10, temperature=0)  # longer than block_size: cropped
    assert len(g) == 21 and g.max() < 256
    with pytest.raises(ValueError, match="prompt"):
        train.generate(eng.next_logits, 8, "", 3)


def test_generate_top_k_and_temperature():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    ids = train.generate(lambda ctx: logits, 4, [0], 400, temperature=1.0, top_k=2, rng=np.random.default_rng(1))
    assert set(ids[1:].tolist()) == {0, 1}  # only the two most likely
    assert list(train.generate(lambda ctx: logits, 4, [3], 3, temperature=0)) == [3, 0, 0, 0]


# -----------------------------------------------------------------------------
# configuration errors: each named, each before any training (no log.jsonl written)

@pytest.mark.parametrize("flags, message", [
    (["--d-model", "65"], "d_model 65 is not divisible by n_head 2"),
    (["--seq-len", "128"], r"sequence length 128 \(--seq-len\) is longer than the block size 64"),
    (["--block-size", "16", "--seq-len", "17"], "sequence length 17 .* longer than the block size 16"),
    (["--backend", "numpy", "--precision", "fp16"], "precision 'fp16' needs a kernel backend"),
    (["--backend", "numpy", "--precision", "bf16"], "precision 'bf16' needs a kernel backend"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be 0"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--backend", "numpy", "--graphs", "on"], "graphs='on': CUDA graphs replay the hip backend's step"),
])
def test_config_errors(tmp_path, flags, message):
    with pytest.raises(train.ConfigError, match=message):
        train.main(flags + ["--out", str(tmp_path)])
    assert not (tmp_path / "log.jsonl").exists()


def test_block_size_too_long_for_data(tmp_path):
    data = tmp_path / "small.txt"
    data.write_bytes(b"hello world\n" * 50)  # 600 bytes: block size 64 needs 641
    with pytest.raises(train.ConfigError, match="has 600 bytes.*641"):
        train.main(["--data", str(data), "--out", str(tmp_path / "o")])
    train.main(TOY + ["--data", str(data), "--steps", "1", "--out", str(tmp_path / "o")])  # block size 16 fits


def test_data_missing_or_empty(tmp_path):
    with pytest.raises(train.ConfigError, match="data file not found: .*nope.txt"):
        train.main(["--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")])
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(train.ConfigError, match="data file is empty"):
        train.main(["--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_custom_data_trains(tmp_path):
    data = tmp_path / "abc.txt"
    data.write_bytes(b"abcabcabd" * 200)
    s = train.main(["--backend", "numpy", "--data", str(data), "--block-size", "16", "--steps", "5",
                    "--eval-batches", "1", "--sample-tokens", "0", "--out", str(tmp_path / "o"), "--no-progress"])
    assert s["steps"] == 5


def test_backend_the_machine_lacks(tmp_path, monkeypatch):
    from gpullm_lessons import device

    monkeypatch.setattr(device, "has_gpu", lambda: False)
    with pytest.raises(train.ConfigError, match="backend 'hip' needs a GPU and this machine has none"):
        train.main(["--backend", "hip", "--out", str(tmp_path)])
    assert not (tmp_path / "log.jsonl").exists()


@pytest.mark.parametrize("flag, value, known", [("--backend", "tpu", "numpy"), ("--precision", "fp8", "bf16"),
                                                ("--checkpointing", "some", "selective")])
def test_unknown_choice(tmp_path, capsys, flag, value, known):
    with pytest.raises(SystemExit) as e:  # the command line: argparse names the flag and the choices
        train.main([flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: '{value}'" in err and known in err
    args = train.build_parser().parse_args(["--out", str(tmp_path)])  # train() called directly
    setattr(args, flag[2:], value)
    with pytest.raises(train.ConfigError, match=f"unknown {flag} '{value}': choose one of .*{known}"):
        train.train(args)


def test_cli_prints_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.cli(["--data", str(tmp_path / "missing.txt")])
    assert e.value.code == 2
    assert "error: data file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        train.cli(["--backend", "numpy", "--precision", "bf16", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: precision 'bf16' needs a kernel backend")


def test_presets():
    assert train.PRESETS["tiny"] == dict(n_layer=2, n_head=2, d_model=64, block_size=64, vocab_size=256,
                                         batch_size=16, lr=1e-3)
    c = train.PRESETS["course"]
    assert (c["n_layer"], c["n_head"], c["d_model"], c["block_size"]) == (6, 6, 384, 256)
    g = train.PRESETS["gpt2"]
    assert (g["n_layer"], g["n_head"], g["d_model"], g["block_size"], g["vocab_size"]) == (12, 12, 768, 1024, 50304)
