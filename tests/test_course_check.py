"""parallel/course_check.py: lesson 13's five strategies on the course preset, 2 and 4 MPI ranks against one rank.

The whole check runs here (about two minutes on 2 cores): every strategy within its loss and memory tolerances, or
refused for the reason the preset's shape gives. Its comparisons are shown failing on planted wrong numbers, and the
stored run lesson 13 prints (results/strategies_course_cpu.json, `make strategies`) is held to the same rules.
"""

import pytest

from gpullm_lessons.bench import stored
from gpullm_lessons.model.params import PRESETS
from gpullm_lessons.parallel import course_check as cc

from test_comm import require_mpi


def assert_course_rows(res):
    """Every strategy on 2 and 4 ranks: ok within both tolerances, or refused where the course preset does not split."""
    course = PRESETS["course"]
    assert res["preset"] == "course" and res["ok"]
    assert (res["loss_tolerance"], res["memory_tolerance"]) == (cc.LOSS_TOLERANCE, cc.MEMORY_TOLERANCE)
    rows = {(r["strategy"], r["ranks"]): r for r in res["rows"]}
    assert set(rows) == {(s, n) for s in cc.STRATEGIES for n in (2, 4)}
    for (name, N), r in rows.items():
        command = cc.STRATEGIES[name][0]
        splits = course["n_head"] % N == 0 if command in ("tensor", "ulysses") else course["n_layer"] >= N
        if not splits:
            assert r["status"] == "refused" and f"--n-head {course['n_head']} does not split over {N}" in r["reason"], r
            continue
        assert r["status"] == "ok", r
        assert r["max_loss_diff"] == max(abs(a - b) for a, b in zip(r["losses"], r["one_rank_losses"]))
        assert r["max_loss_diff"] <= cc.LOSS_TOLERANCE and len(r["losses"]) == res["steps"]
        assert r["memory"]["ok"] and len(r["memory"]["measured"]) == N  # per rank (per stage: one per rank)
    return rows


def test_the_course_preset_on_2_and_4_ranks():
    require_mpi()
    rows = assert_course_rows(cc.run("course", ranks=(2, 4), steps=2, log=lambda line: None))
    assert rows[("pipeline-1f1b", 4)]["memory"]["measured"] == rows[("pipeline-1f1b", 4)]["memory"]["predicted"]


def test_a_loss_off_by_more_than_the_tolerance_is_wrong(monkeypatch):
    """The one-rank reference planted 1e-4 off: the 2-rank row is 'wrong' and the run is not ok."""
    require_mpi()
    real = cc._module

    def planted(command):
        module = real(command)

        class Off:
            @staticmethod
            def main(args, comm):
                res = module.main(args, comm=comm)
                res["losses"] = [x + 1e-4 for x in res["losses"]]
                return res

        return Off

    monkeypatch.setattr(cc, "_module", planted)
    res = cc.run("tiny", ranks=(2,), steps=2, strategies=["zero3"], log=lambda line: None)
    (row,) = res["rows"]
    assert row["status"] == "wrong" and not res["ok"] and row["max_loss_diff"] > cc.LOSS_TOLERANCE
    assert row["memory"]["ok"]  # only the losses were planted


def test_the_memory_comparison_fails_on_wrong_numbers():
    zero = {"peak_bytes": [[1000, 1000]], "memory_model": {"peak": 1000}}
    assert cc.memory_check("zero3", {}, zero, 2)["ok"]
    zero["peak_bytes"] = [[1000, 1150]]  # one rank 15% over: the model missed something
    assert not cc.memory_check("zero3", {}, zero, 2)["ok"]
    one = {"cache_bytes": [[4000]]}
    assert cc.memory_check("ulysses", one, {"cache_bytes": [[2000, 2000]]}, 2)["ok"]
    assert not cc.memory_check("ulysses", one, {"cache_bytes": [[4000, 4000]]}, 2)["ok"]  # each rank kept it all
    pipe = {"peak_activations": [2, 1], "peak_activations_table": [2, 1]}
    assert cc.memory_check("pipeline", {}, pipe, 2)["ok"]
    pipe["peak_activations"] = [4, 4]  # GPipe's count under a 1F1B table
    assert not cc.memory_check("pipeline", {}, pipe, 2)["ok"]
    with pytest.raises(ValueError, match="no memory model for 'ring'"):
        cc.memory_check("ring", {}, {}, 2)
    with pytest.raises(ValueError, match="no strategy 'fsdp'"):
        cc.run("tiny", strategies=["fsdp"])


def test_the_stored_course_run():
    """What lesson 13 prints: a run of `make strategies`, held to the same rules as the live one."""
    res = stored.require("strategies_course_cpu")
    assert res["card"].startswith("CPU: ") and res["date"] and res["commit"]
    assert_course_rows(res)
