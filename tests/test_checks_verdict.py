"""The checker core (gpullm_lessons.checks.verdict): one wording for not attempted / error, one cut of an exception's text,
the place in the learner's code, and one record for grading, whichever checker module uses it."""

import json

import pytest

import gpullm_lessons  # noqa: F401  (first: switches the CUDA simulator on before numba loads)
from gpullm_lessons.checks import backward as checks, verdict


def _todo(*args):
    raise NotImplementedError("exercise: write this part")


def _buggy(x):
    return [x][3]  # IndexError, raised here: this file is the learner's code


def test_call_learner_not_attempted_is_one_line_with_the_hint_apart():
    value, r = verdict.call_learner("op", _todo, (1, 2), task="t", seed=3)
    assert value is None and r.status == "not attempted" and not r.passed and r.task == "t" and r.seed == 3
    assert r.message == "op: not attempted (your function raised NotImplementedError)"
    assert r.hint == verdict.NOT_ATTEMPTED_HINT


def test_call_learner_error_names_the_line_and_the_context():
    value, r = verdict.call_learner("op", _buggy, (1,), context="x = 1 (seed 5)", task=None)
    assert value is None and r.status == "error"
    head, hint = r.message.splitlines()
    assert head == "op: error - your function raised IndexError: list index out of range"
    assert hint.startswith("  hint: the error is in your code (at line ") and "in _buggy)" in hint
    assert hint.endswith("; x = 1 (seed 5)")
    assert verdict.call_learner("op", lambda: 7, task=None) == (7, None)


def test_lead_replaces_the_default_words():
    _, r = verdict.call_learner(
        "op", _buggy, (1,), lead=lambda e: "an index past the end" if isinstance(e, IndexError) else None, task=None
    )
    assert r.hint.startswith("an index past the end (at line ")


def test_error_text_is_cut_one_way():
    text = verdict.error_text(ValueError("word " * 100))
    assert len(text) == verdict.ERROR_TEXT_MAX and text.endswith("...")
    assert verdict.error_text(ValueError("a\n  b")) == "a b"
    assert verdict.error_message("op", KeyError()) == "op: error - your function raised KeyError"


def test_unfinished_kernel_names_the_kernel():
    r = verdict.unfinished("op", "stub_kernel", task=None)
    assert r.message == "op: not attempted (your kernel stub_kernel still raises NotImplementedError)"
    assert "in stub_kernel" in r.hint


def test_record_logs_the_whole_verdict_on_one_line(tmp_path, monkeypatch, capsys):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("GPULLM_GRADE_LOG", str(log))
    r = verdict.verdict("op", "t", "wrong", "op: wrong - x at [1]", "x is off by one")
    assert capsys.readouterr().out == "op: wrong - x at [1]\n  hint: x is off by one\n" and not r.passed
    verdict.verdict("check_op2", None, "correct", "op2: correct", quiet=True, check=None)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries[0] == {
        "check": "check_op",
        "task": "t",
        "status": "wrong",
        "message": "op: wrong - x at [1] hint: x is off by one",
    }
    assert entries[1]["check"] == "check_op2" and capsys.readouterr().out == ""


def test_checks_keeps_its_public_names():
    assert checks.CheckResult is verdict.CheckResult and checks.STATUSES == verdict.STATUSES


@pytest.mark.parametrize(
    "v, other, text", [(0.123456789, None, "0.1235"), (1.00001, 1.00002, "1.00001"), (float("nan"), 1.0, "nan")]
)
def test_fmt(v, other, text):
    assert verdict.fmt(v, other) == text
