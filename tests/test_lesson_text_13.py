"""Lesson 13's prose states numbers its cells compute (parallel/plan.py on the models the lesson names): each is
recomputed here and must appear in the lesson's text as written, so a change to the memory model or the strategies'
messages that moves a number fails until the prose is rewritten."""

import json
from pathlib import Path

from gpullm_lessons.model.params import GPTConfig, num_params, preset_config
from gpullm_lessons.parallel import plan

ROOT = Path(__file__).resolve().parents[1]
NB = json.loads((ROOT / "notebooks" / "13_beyond_one_gpu.ipynb").read_text(encoding="utf-8"))
TEXT = " ".join("".join(c["source"]) for c in NB["cells"] if c["cell_type"] == "markdown").replace("\n", " ")
GPT2 = preset_config("gpt2")[0]
B13 = GPTConfig(vocab_size=50304, block_size=2048, n_layer=40, n_head=40, d_model=5120)
B175 = GPTConfig(vocab_size=50304, block_size=2048, n_layer=96, n_head=96, d_model=12288)


def test_the_gpt2_floors_and_the_embedding_share():
    psi = num_params(GPT2)
    assert f"{10 * psi / 2**30:.2f} and {6 * psi / 2**30:.2f} GiB" in TEXT  # ZeRO-1's and ZeRO-2's floors
    assert f"{GPT2.vocab_size * GPT2.d_model / 1e6:.1f}M of its {psi / 1e6:.0f}M" in TEXT


def test_the_fits_table_sentences():
    card = 80 * 10**9
    row13, row175 = plan.fits_table({"13B": B13, "175B": B175}, card)
    assert f"A 13B model needs {row13['dp_bytes'] / 1e9:.0f} GB" in TEXT
    assert f"(10 Ψ alone is {10 * num_params(B13) / 1e9:.0f} GB)" in TEXT
    assert row13["dp"] is None and row13["zero1"] is None and row13["zero2"] == 64  # "ZeRO-2 just squeezes under at 64"
    assert "ZeRO-2 just squeezes under at 64 ranks" in TEXT
    assert row13["zero3"] == row13["tensor"] == row13["pipeline"] == 4 and "fit it on 4" in TEXT
    assert row175["zero3"] == row175["pipeline"] == 64 and row175["tensor"] is None
    assert "ZeRO-3 or a pipeline spreads it over 64 cards" in TEXT


def test_the_message_counts_and_sizes_of_the_gpt2_pair():
    tp = plan.comm_per_step(GPT2, 32, 1024, 2, "tensor")
    assert f"{len(tp)} all-reduces of {tp[0][1] / 1e6:.0f} MB" in TEXT
    z3, dp = (plan.comm_per_step(GPT2, 32, 1024, 2, s) for s in ("zero3", "dp"))
    assert round(plan.sent_bytes(z3, 2) / 1e6) == round(plan.sent_bytes(dp, 2) / 1e6)  # "the same bytes"
    assert f"the same bytes in {len(z3)} messages" in TEXT
