"""Lessons 11 and 12 say what their cells compute: every timing table of lesson 11 checks its versions against the
reference first, its sections are numbered in order and every "section N" points at one, the roofline paragraph's
numbers are the ones the stored ceilings give, no time of a stored row known not to be valid appears in the text,
and lesson 12's CPU training cell is small without a GPU and says how long it takes."""
import json
import re
from pathlib import Path

import pytest

from gpullm_lessons.bench import kernels as bench, stored
from gpullm_lessons.checks import flash as checks_flash
from gpullm_lessons import viz

ROOT = Path(__file__).resolve().parents[1]


def cells(name):
    return json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]


def source(cell):
    return "".join(cell["source"])


def by_id(name):
    return {c["id"]: source(c) for c in cells(name)}


L11, L12 = "11_flash_attention", "12_memory"


def test_every_timing_table_of_lesson_11_checks_its_versions_first():
    timed = [source(c) for c in cells(L11) if c["cell_type"] == "code" and "bench.kernel_results(" in source(c)]
    assert len(timed) >= 4
    for src in timed:
        assert src.count("bench.kernel_results(") == src.count("checks_flash.checked(bench.kernel_results("), src
    ncu = [source(c) for c in cells(L11) if 'stored.require("ncu_flash_h200")' in source(c)]
    assert ncu and all('checks_flash.checked(stored.require("ncu_flash_h200"))' in s for s in ncu)


def test_lesson_11_sections_are_numbered_in_order_and_every_reference_exists():
    text = [source(c) for c in cells(L11) if c["cell_type"] == "markdown"]
    numbers = [int(n) for t in text for n in re.findall(r"^## (\d+)\. ", t, re.M)]
    assert numbers == list(range(1, len(numbers) + 1))
    titles = {int(n): title for t in text for n, title in re.findall(r"^## (\d+)\. (.*)$", t, re.M)}
    assert titles[11].startswith("v5") and titles[12].startswith("v6")
    assert not any(re.search(r"^### v\d", t, re.M) for t in text)  # every version has a section of its own
    for t in text:
        for group in re.findall(r"\bsections? ((?:\d+)(?:(?: and| to) \d+)*)", t):
            for n in re.findall(r"\d+", group):
                assert 1 <= int(n) <= max(numbers), (n, group)
    assert "the v4 section's list" not in "".join(text) and "v4\nin the runs of this section" not in "".join(text)


def test_the_roofline_paragraph_states_what_the_stored_ceilings_give():
    nb = by_id(L11)
    assert "memory-bound" not in nb["l11-bytes"].splitlines()[0]
    assert "16 per byte in fp32\nand 32 in bf16" in nb["l11-bytes"]
    ceil = bench.stored_ceilings()
    ridge = {f: ceil[f"matmul_{f}"]["TFLOP/s"] * 1e3 / ceil["copy"]["GB/s"] for f in ("fp32", "bf16")}
    ai = {f: [4 * 16 * 12 * T * T * 64 / viz.attention_traffic(16, 12, T, 64, elem=e)["scores_path"]
              for T in (256, 1024, 4096)] for f, e in (("fp32", 4), ("bf16", 2))}
    said = " ".join(nb["l11-bytes-read"].split())
    assert f"{round(min(ai['fp32']))} to {round(max(ai['fp32']))} FLOPs per byte" in said
    assert f"to {round(min(ai['bf16']))} to {round(max(ai['bf16']))}" in said
    assert f"fp32 ridge point of {round(ridge['fp32'])}" in said
    assert f"about {round(ridge['bf16'], -1):.0f} FLOPs per byte" in said or f"about {round(ridge['bf16'])} FLOPs" in said
    assert min(ai["fp32"]) > ridge["fp32"] and "compute-bound" in said  # above the fp32 ridge at every T
    assert max(ai["bf16"]) < ridge["bf16"] and "memory-bound" in said   # far below the bf16 ridge


def test_no_time_of_a_stored_row_that_is_not_valid_appears_in_the_lesson():
    text = "".join(source(c) for c in cells(L11) if c["cell_type"] == "markdown")
    for name in ("ncu_flash_h200",):
        run = stored.require(name)
        bad = checks_flash.NOT_VALID[run["card"], run["date"]]
        for r in run["rows"]:
            if (r["op"], str(r["version"])) in bad:
                for shown in ([f"{r['ms']:.3f}", f"{r['ms']:.2f}"] if "ms" in r else [f"{r['duration_us']:.1f}"]):
                    assert shown not in text, (name, r["version"], shown)
    assert "not valid" in text


def test_lesson_12_trains_the_course_preset_briefly_without_a_gpu_and_says_how_long():
    nb = by_id(L12)
    assert "STEPS = device.pick(" in nb["l12-bf16-train"] and "range(STEPS)" in nb["l12-bf16-train"]
    assert re.search(r"\d+ seconds", nb["l12-bf16-predict"])


@pytest.mark.parametrize("words", ["today's model", "the stored run"])
def test_lesson_12_says_which_model_the_edge_run_and_the_table_are(words):
    nb = by_id(L12)
    assert words in nb["l12-fits-edge"] and "today's model" in nb["l12-fits"]
    assert "has not been measured again" not in nb["l12-fits-after"]
