"""make sanitize (gpullm_lessons/bench/sanitize.py) without a GPU: a stand-in compute-sanitizer shows that a part is
reported clean only when the sanitizer counted no error and the tests passed, and that every other outcome (errors
in one of several processes, failed tests, no summary, a hang) makes the run fail with the part named."""

import datetime
import json
import os
import stat
import subprocess
import time

import pytest

from gpullm_lessons.bench import sanitize


def _fake(tmp_path, body):
    """A stand-in compute-sanitizer: a shell script that prints what `body` says and exits with its status."""
    p = tmp_path / "compute-sanitizer"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


CLEAN = "echo '1 passed'; echo '========= ERROR SUMMARY: 0 errors'"
RACE = (
    "echo '========= Error: Race reported between Write access at flash_dq+0x1a0'; echo '1 passed'; "
    "echo '========= ERROR SUMMARY: 0 errors'; echo '========= ERROR SUMMARY: 3 errors'"
)


def test_classify_counts_every_process_and_names_the_first_error():
    out = (
        "=== Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 2 errors\nx\n== ERROR SUMMARY: 1 error\n"
    )
    status, n, first = sanitize.classify(out, 0)
    assert (status, n) == ("errors", 3) and "Invalid __global__ read" in first
    assert sanitize.classify("1 passed\n========= ERROR SUMMARY: 0 errors\n", 0)[0] == "clean"
    assert sanitize.classify("1 failed\n========= ERROR SUMMARY: 0 errors\n", 1)[:2] == ("tests failed", 0)
    assert sanitize.classify("Segmentation fault\n", 139)[0] == "no summary"
    race = "4 passed\n========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n"
    assert sanitize.classify(race, 0)[:2] == ("errors", 2)
    assert (
        sanitize.classify(
            race.replace("2 hazards", "0 hazards").replace("(1 error, 1 warning)", "(0 errors, 0 warnings)"), 0
        )[0]
        == "clean"
    )


@pytest.mark.parametrize(
    "body, status",
    [
        (CLEAN, "clean"),
        (RACE, "errors"),
        ("echo '1 failed'; echo '== ERROR SUMMARY: 0 errors'; exit 1", "tests failed"),
        ("echo 'crashed'; exit 3", "no summary"),
        ("sleep 30", "timeout"),
    ],
)
def test_a_part_is_clean_only_when_the_sanitizer_and_the_tests_say_so(tmp_path, monkeypatch, body, status):
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _fake(tmp_path, body))
    rc = sanitize.main(
        [
            "--files",
            "tests/test_sanitize.py",
            "--tools",
            "racecheck",
            "--timeout",
            "3",
            "--logs",
            str(tmp_path / "logs"),
        ]
    )
    part = sanitize.run_part(sanitize.Part("racecheck", "tests/test_sanitize.py"), sanitize.find_sanitizer(), 3)
    assert part.status == status
    assert rc == (0 if status == "clean" else 1)
    assert (tmp_path / "logs" / "test_sanitize.racecheck.log").exists()


def test_the_command_runs_the_gpu_tests_of_one_file_with_api_probes_not_counted():
    cmd = sanitize.command(
        "/cuda/bin/compute-sanitizer", "racecheck", "tests/test_hip_flash.py", python="py", select="not 4096"
    )
    assert cmd[:3] == ["/cuda/bin/compute-sanitizer", "--tool", "racecheck"]
    assert "--report-api-errors" in cmd and cmd[cmd.index("--report-api-errors") + 1] == "no"
    assert cmd[cmd.index("py") :] == [
        "py",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=10",
        "-m",
        "gpu",
        "-x",
        "tests/test_hip_flash.py",
        "-k",
        "not 4096",
    ]


def test_the_default_parts_are_test_files_that_exist_and_launch_gpu_kernels():
    for f in sanitize.DEFAULT_FILES:
        text = (sanitize.ROOT / f).read_text()
        assert "gpu" in text, f


def test_bad_usage_is_named(tmp_path, monkeypatch, capsys):
    assert sanitize.main(["--tools", "memcheck,speedcheck", "--list"]) == 2
    assert "speedcheck not one of" in capsys.readouterr().err
    assert sanitize.main(["--files", "tests/nope.py", "--list"]) == 2
    assert "tests/nope.py not found" in capsys.readouterr().err
    monkeypatch.setenv(sanitize.SANITIZER_ENV, str(tmp_path / "missing"))
    assert sanitize.main(["--files", "tests/test_sanitize.py"]) == 2
    assert "is not an executable file" in capsys.readouterr().err
    monkeypatch.delenv(sanitize.SANITIZER_ENV)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path))
    if not os.access("/usr/local/cuda/bin/compute-sanitizer", os.X_OK):
        with pytest.raises(sanitize.SanitizeError, match="compute-sanitizer not found"):
            sanitize.find_sanitizer()


# ---- --jobs, --chunk, --shard, --out and merge ---------------------------------------------------------------------

TWO_FILES = "tests/test_sanitize.py,tests/test_gpu_suite.py"


def _recording(tmp_path, body=CLEAN, sleep="0"):
    """A stand-in that records, per run, its tool, its start and end times and its arguments under tmp_path/runs/.

    `sleep` is a shell expression for the seconds it waits (it may look at the tool, "$2")."""
    runs = tmp_path / "runs"
    runs.mkdir()
    return _fake(
        tmp_path,
        f"s=$(date +%s.%N); sleep {sleep}; e=$(date +%s.%N)\n"
        f'echo "$2 $s $e" > {runs}/$$.time; printf "%s\\n" "$@" > {runs}/$$.args\n{body}',
    )


def _times(tmp_path):
    """{tool: (start, end)} of the stand-in's runs."""
    rows = [f.read_text().split() for f in (tmp_path / "runs").glob("*.time")]
    return {tool: (float(s), float(e)) for tool, s, e in rows}


def test_jobs_run_parts_side_by_side_and_the_table_keeps_the_parts_order(tmp_path, monkeypatch, capsys):
    # memcheck, the first part, finishes last: the lines as parts finish and the table afterwards differ in order
    sleep = '$(case "$2" in memcheck) echo 2.5;; racecheck) echo 1;; initcheck) echo 2;; *) echo 1.5;; esac)'
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _recording(tmp_path, sleep=sleep))
    tools = ["memcheck", "racecheck", "initcheck", "synccheck"]
    args = ["--files", "tests/test_sanitize.py", "--tools", ",".join(tools), "--logs", str(tmp_path / "logs")]
    assert sanitize.main(args + ["--jobs", "4"]) == 0
    times = _times(tmp_path)
    assert sorted(times) == sorted(tools)
    # all four ran at once: the last one started before the first one ended (in turn, each starts after one ends)
    assert max(s for s, _ in times.values()) < min(e for _, e in times.values())
    out = capsys.readouterr().out.splitlines()
    finished = [ln.split()[1] for ln in out if ln.startswith("[")]
    assert finished == sorted(tools, key=lambda t: times[t][1]) != tools  # printed as each part finished
    table = [ln.split()[0] for ln in out[out.index(next(ln for ln in out if ln.startswith("[4/4]"))) + 1 :]]
    assert table[: len(tools)] == tools  # then the table, in the parts' order


def test_one_job_runs_the_parts_one_after_the_other(tmp_path, monkeypatch):
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _recording(tmp_path, sleep="0.3"))
    args = ["--files", "tests/test_sanitize.py", "--tools", "memcheck,racecheck,initcheck", "--jobs", "1"]
    assert sanitize.main(args + ["--logs", str(tmp_path / "logs")]) == 0
    spans = sorted(_times(tmp_path).values())
    assert len(spans) == 3 and all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_a_deadline_stops_the_run_and_still_writes_the_summary(tmp_path, monkeypatch):
    _stand_in_card(monkeypatch)
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _recording(tmp_path, sleep="30"))
    args = ["--files", "tests/test_sanitize.py", "--tools", "memcheck,racecheck,initcheck", "--jobs", "1"]
    t0 = time.time()
    rc = sanitize.main(args + ["--deadline", "2", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "o")])
    assert rc == 1 and time.time() - t0 < 20  # the first part stopped at the deadline, not after its 30 s
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    got = [(p["tool"], p["status"], p["first_error"]) for p in s["parts"]]
    assert got == [
        ("memcheck", "timeout", "stopped at --deadline"),
        ("racecheck", "not run", "not started before --deadline"),
        ("initcheck", "not run", "not started before --deadline"),
    ]
    assert (s["deadline_s"], s["clean"]) == (2.0, False)


CHUNKY = """import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("n", ["a b", 1, 2, 3, 4])
def test_gpu(n):
    pass


def test_cpu():
    pass
"""


def test_chunks_pass_the_gpu_tests_node_ids_a_few_at_a_time(tmp_path, monkeypatch):
    test_file = tmp_path / "test_chunky.py"  # outside the checkout: an absolute path
    test_file.write_text(CHUNKY)
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _recording(tmp_path))
    args = ["--files", str(test_file), "--tools", "memcheck,racecheck", "--chunk", "2", "--jobs", "3"]
    assert sanitize.main(args + ["--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "out")]) == 0
    ids = [f"{test_file}::test_gpu[{n}]" for n in ("a b", 1, 2, 3, 4)]  # not test_cpu: only the GPU tests
    runs = []
    for f in (tmp_path / "runs").glob("*.args"):
        argv = f.read_text().splitlines()
        pytest_args = argv[argv.index("pytest") :]
        assert pytest_args[:8] == ["pytest", "-q", "-p", "no:cacheprovider", "--durations=10", "-m", "gpu", "-x"]
        assert str(test_file) not in argv  # the ids, not the file
        runs.append((argv[1], pytest_args[8:]))
    want = [ids[0:2], ids[2:4], ids[4:5]]
    assert sorted(runs) == sorted((tool, chunk) for tool in ("memcheck", "racecheck") for chunk in want)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(p["tool"], p["chunk"]) for p in summary["parts"]] == [
        (tool, f"{k}/3") for tool in ("memcheck", "racecheck") for k in (1, 2, 3)
    ]
    assert summary["all_parts"][1] == f"memcheck {test_file} [2/3]" and summary["chunk"] == 2
    logs = sorted(f.name for f in (tmp_path / "logs").iterdir())  # one log per part: none overwrites another
    assert logs == sorted(f"test_chunky.{k}of3.{tool}.log" for tool in ("memcheck", "racecheck") for k in (1, 2, 3))


def test_one_tool_can_take_smaller_chunks(tmp_path, monkeypatch):
    """--chunk 2,racecheck=1: memcheck's parts hold 2 tests, racecheck's 1 (racecheck is the slow one); initcheck,
    with no size of its own, takes the default; the summary says each tool's size."""
    test_file = tmp_path / "test_chunky.py"
    test_file.write_text(CHUNKY)
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _recording(tmp_path))
    args = ["--files", str(test_file), "--tools", "memcheck,racecheck,initcheck", "--chunk", "2,racecheck=1"]
    assert sanitize.main(args + ["--jobs", "3", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(p["tool"], p["chunk"]) for p in summary["parts"]] == (
        [("memcheck", f"{k}/3") for k in (1, 2, 3)]
        + [("racecheck", f"{k}/5") for k in (1, 2, 3, 4, 5)]
        + [("initcheck", f"{k}/3") for k in (1, 2, 3)]
    )
    assert summary["chunk"] == {"memcheck": 2, "racecheck": 1, "initcheck": 2}
    runs = [f.read_text().splitlines() for f in (tmp_path / "runs").glob("*.args")]
    sizes = sorted((argv[1], len(argv) - argv.index("gpu") - 2) for argv in runs)  # after "-m gpu -x": the ids
    assert sizes.count(("racecheck", 1)) == 5 and sizes.count(("memcheck", 2)) == 2 and ("memcheck", 1) in sizes


@pytest.mark.parametrize("bad", ["-1", "x", "2,racecheck", "2,racecheck=", "2,leakcheck=1", "racecheck=-2"])
def test_a_bad_chunk_is_refused_with_its_form(bad, capsys):
    assert sanitize.main(["--files", "tests/test_sanitize.py", "--chunk", bad, "--list"]) == 2
    err = capsys.readouterr().err
    assert "--chunk" in err and (f"got '{bad.split(',')[-1]}'" in err or "not one of memcheck" in err), err


def test_a_file_whose_gpu_tests_cannot_be_collected_is_named(tmp_path, capsys):
    broken = tmp_path / "test_broken.py"
    broken.write_text("def test_(:\n")
    assert sanitize.main(["--files", str(broken), "--chunk", "2", "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "test_broken.py" in err and "1 error" in err  # pytest's last line
    no_gpu = tmp_path / "test_cpu_only.py"
    no_gpu.write_text("def test_cpu():\n    pass\n")
    assert sanitize.main(["--files", str(no_gpu), "--chunk", "2", "--list"]) == 2
    err = capsys.readouterr().err
    assert "test_cpu_only.py" in err and "no tests collected" in err


def test_a_shard_is_every_nth_part_and_the_shards_together_are_the_whole_run(capsys):
    args = ["--files", "tests/test_sanitize.py,tests/test_gpu_suite.py,tests/test_hip.py", "--list"]

    def listed(*more):
        assert sanitize.main(args + list(more)) == 0
        return capsys.readouterr().out.splitlines()

    whole = listed()
    assert len(whole) == 6 and listed("--shard", "1/1") == whole
    shards = [listed("--shard", f"{i}/4") for i in (1, 2, 3, 4)]
    assert shards == [whole[0::4], whole[1::4], whole[2::4], whole[3::4]]
    assert shards[1] == [whole[1], whole[5]]  # files x tools: the second and the sixth part


@pytest.mark.parametrize("bad", ["0/3", "4/3", "x", "1/0", "2"])
def test_a_bad_shard_is_refused(bad, capsys):
    assert sanitize.main(["--files", "tests/test_sanitize.py", "--shard", bad, "--list"]) == 2
    assert (
        f"--shard takes I/N with 1 <= I <= N (e.g. 2/3: the second of 3 shards), got '{bad}'" in capsys.readouterr().err
    )


def test_bad_jobs_and_chunk_are_refused(capsys):
    assert sanitize.main(["--files", "tests/test_sanitize.py", "--jobs", "0", "--list"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err
    assert sanitize.main(["--files", "tests/test_sanitize.py", "--chunk", "-1", "--list"]) == 2
    assert "--chunk must be 0" in capsys.readouterr().err


def _stand_in_card(monkeypatch, card="Stand-in GPU", commit="abc123"):
    """Card, driver and commit as gpu_suite's helpers find them: a stand-in card, the commit from GPULLM_COMMIT."""
    from gpullm_lessons.bench import gpu_suite

    monkeypatch.setattr(gpu_suite, "_card", lambda: {"card": card, "driver": "999.1"})
    monkeypatch.setenv("GPULLM_COMMIT", commit)
    monkeypatch.setenv("GPULLM_DIRTY", "1")


def test_the_summary_says_where_when_what_and_each_part(tmp_path, monkeypatch):
    _stand_in_card(monkeypatch)
    racecheck_finds = f'case "$2" in racecheck) {RACE};; *) {CLEAN};; esac'
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _fake(tmp_path, racecheck_finds))
    args = ["--files", TWO_FILES, "--jobs", "2", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "out")]
    assert sanitize.main(args) == 1
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (s["what"], s["card"], s["driver"], s["commit"], s["dirty"]) == (
        "make sanitize",
        "Stand-in GPU",
        "999.1",
        "abc123",
        True,
    )
    assert s["date"] == datetime.date.today().isoformat() and datetime.datetime.fromisoformat(s["started"])
    assert (s["tools"], s["shard"], s["jobs"], s["chunk"]) == (["memcheck", "racecheck"], "1/1", 2, 0)
    assert s["command"].startswith("python -m gpullm_lessons.bench.sanitize --files ") and "--jobs 2" in s["command"]
    assert isinstance(s["minutes"], float) and s["minutes"] >= 0
    files = TWO_FILES.split(",")
    assert [(p["tool"], p["file"], p["chunk"]) for p in s["parts"]] == [
        (tool, f, "") for f in files for tool in ("memcheck", "racecheck")
    ]
    assert set(s["parts"][0]) == {"tool", "file", "chunk", "status", "errors", "seconds", "first_error"}
    assert [(p["status"], p["errors"]) for p in s["parts"]] == [("clean", 0), ("errors", 3)] * 2
    assert "Race reported" in s["parts"][1]["first_error"]
    assert s["parts_total"] == 4 and s["all_parts"][1] == "racecheck tests/test_sanitize.py"
    assert (s["clean"], s["exit_status"]) == (False, 1)


def _shards(tmp_path, monkeypatch):
    """Shards 1/2 and 2/2 of a clean run of 4 parts: the paths of their summaries."""
    _stand_in_card(monkeypatch)
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _fake(tmp_path, CLEAN))
    paths = []
    for i in (1, 2):
        out = tmp_path / f"shard{i}"
        args = ["--files", TWO_FILES, "--shard", f"{i}/2", "--logs", str(tmp_path / "logs"), "--out", str(out)]
        assert sanitize.main(args) == 0
        paths.append(out / "summary.json")
    return paths


def _edit(path, **changes):
    s = json.loads(path.read_text())
    s.update(changes)
    path.write_text(json.dumps(s))
    return s


def test_merged_shards_are_the_whole_run(tmp_path, monkeypatch, capsys):
    one, two = _shards(tmp_path, monkeypatch)
    first = _edit(one, minutes=1.25)
    _edit(two, minutes=2.5)
    into = tmp_path / "merged" / "summary.json"
    assert sanitize.main(["merge", str(one), str(two), "--into", str(into)]) == 0
    m = json.loads(into.read_text())
    assert (m["clean"], m["exit_status"], m["missing"], m["minutes"]) == (True, 0, [], 3.75)
    # the parts in the whole run's order (shard 1 holds the first and third, shard 2 the second and fourth)
    keys = [sanitize._from_row(p).key for p in m["parts"]]
    assert keys == first["all_parts"] and len(keys) == m["parts_total"] == 4
    assert (m["card"], m["commit"], m["shard"]) == ("Stand-in GPU", "abc123", "1/2,2/2")
    assert "4 of 4 parts clean; 0 missing" in capsys.readouterr().out


def test_a_merge_without_every_shard_or_with_a_dirty_part_is_not_clean(tmp_path, monkeypatch, capsys):
    one, two = _shards(tmp_path, monkeypatch)
    into = tmp_path / "merged.json"
    assert sanitize.main(["merge", str(one), "--into", str(into)]) == 1  # every part of shard 1 is clean
    m = json.loads(into.read_text())
    assert m["clean"] is False and m["missing"] == [
        "racecheck tests/test_sanitize.py",
        "racecheck tests/test_gpu_suite.py",
    ]
    assert "MISSING racecheck tests/test_sanitize.py" in capsys.readouterr().out
    s = json.loads(two.read_text())
    s["parts"][1]["status"] = "timeout"
    two.write_text(json.dumps(s))
    assert sanitize.main(["merge", str(one), str(two), "--into", str(into)]) == 1
    m = json.loads(into.read_text())
    assert (m["clean"], m["missing"]) == (False, [])


@pytest.mark.parametrize(
    "change, said",
    [
        ({"commit": "def456"}, "of different runs: commit (abc123 vs def456)"),
        ({"card": "Other GPU"}, "of different runs: card (Stand-in GPU vs Other GPU)"),
        ({"all_parts": ["memcheck tests/test_sanitize.py"], "parts_total": 1}, "all_parts (the lists differ)"),
        ("a part of shard 1", "the part memcheck tests/test_sanitize.py is in both"),
        ("shard 1 again", "the part memcheck tests/test_sanitize.py is in both"),
    ],
)
def test_merge_refuses_summaries_of_other_runs_and_a_part_run_twice(tmp_path, monkeypatch, capsys, change, said):
    one, two = _shards(tmp_path, monkeypatch)
    if change == "a part of shard 1":  # a shard 2 that ran the first part of shard 1 as well
        _edit(two, parts=json.loads(two.read_text())["parts"] + json.loads(one.read_text())["parts"][:1])
    elif change == "shard 1 again":
        two.write_text(one.read_text())
    else:
        _edit(two, **change)
    into = tmp_path / "merged.json"
    assert sanitize.main(["merge", str(one), str(two), "--into", str(into)]) == 2
    assert said in capsys.readouterr().err and not into.exists()


def _repo(tmp_path):
    """A git checkout with three commits: the first; one that only adds a lesson; one that changes a kernel."""
    root = tmp_path / "repo"
    (root / "kernels").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "kernels" / "k.cu").write_text("// v1\n")
    (root / "tests" / "test_sanitize.py").write_text("# the part's tests\n")

    def commit(msg):
        env = {
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        }
        subprocess.run(["git", "add", "-A"], cwd=root, check=True, env=env)
        subprocess.run(["git", "commit", "-qm", msg], cwd=root, check=True, env=env)
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True, text=True
        ).stdout.strip()

    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    first = commit("first")
    (root / "notebooks").mkdir()
    (root / "notebooks" / "l.ipynb").write_text("{}\n")
    text_only = commit("a lesson")
    (root / "kernels" / "k.cu").write_text("// v2\n")
    kernel = commit("a kernel")
    return root, first, text_only, kernel


def test_shards_of_two_commits_merge_only_where_the_code_they_ran_is_the_same(tmp_path, monkeypatch):
    """A machine lent for minutes at a time runs the shards in several sittings: a commit in between that only adds
    a lesson leaves the merge clean (both commits listed); one that changes a kernel, or a commit git does not know,
    is refused with the reason."""
    root, first, text_only, kernel = _repo(tmp_path)
    one, two = _shards(tmp_path, monkeypatch)
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert sanitize.code_changed(first, text_only, a["all_parts"], root) == ""
    a["commit"], b["commit"] = first, text_only
    m = sanitize.merge([a, b], ["one", "two"], root=root)
    assert m["clean"] and m["commits"] == sorted([first, text_only])
    b["commit"] = kernel
    with pytest.raises(sanitize.SanitizeError, match=r"the code the parts run differs: kernels/k\.cu"):
        sanitize.merge([a, b], ["one", "two"], root=root)
    (root / "tests" / "test_sanitize.py").write_text("# the part's tests, changed\n")
    subprocess.run(
        ["git", "commit", "-qam", "a test", "--author", "t <t@t>"],
        cwd=root,
        check=True,
        env={**os.environ, "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"},
    )
    assert "tests/test_sanitize.py" in sanitize.code_changed(kernel, "HEAD", a["all_parts"], root)
    b["commit"] = "0" * 40
    with pytest.raises(sanitize.SanitizeError, match="git does not know the commit '0000"):
        sanitize.merge([a, b], ["one", "two"], root=root)


def test_a_later_sitting_runs_only_the_parts_without_a_verdict_and_merges_over_them(tmp_path, monkeypatch, capsys):
    """--skip: a part an earlier sitting finished (clean, errors, tests failed) is not run again; one stopped at the
    deadline or never started is, and merge keeps the finished row. Two finished rows of a part are still refused."""
    _stand_in_card(monkeypatch)
    monkeypatch.setenv(sanitize.SANITIZER_ENV, _fake(tmp_path, CLEAN))
    logs = str(tmp_path / "logs")
    assert sanitize.main(["--files", TWO_FILES, "--logs", logs, "--out", str(tmp_path / "s1")]) == 0
    one = tmp_path / "s1" / "summary.json"
    s = json.loads(one.read_text())
    s["parts"][1].update(status="timeout", first_error="stopped at --deadline")
    s["parts"][3].update(status="not run", first_error="not started before --deadline")
    one.write_text(json.dumps(s))
    capsys.readouterr()
    args = ["--files", TWO_FILES, "--logs", logs, "--skip", str(one), "--out", str(tmp_path / "s2")]
    assert sanitize.main(args) == 0
    two = tmp_path / "s2" / "summary.json"
    ran = [sanitize._from_row(p).key for p in json.loads(two.read_text())["parts"]]
    assert ran == [s["all_parts"][1], s["all_parts"][3]]
    assert "2 of 4 parts" in capsys.readouterr().out
    m = sanitize.merge([json.loads(one.read_text()), json.loads(two.read_text())], ["s1", "s2"])
    assert m["clean"] and [p["status"] for p in m["parts"]] == ["clean"] * 4 and m["missing"] == []
    s["parts"][1]["status"] = "errors"  # a verdict in both sittings: which one holds is not for merge to choose
    with pytest.raises(sanitize.SanitizeError, match="is in both"):
        sanitize.merge([s, json.loads(two.read_text())], ["s1", "s2"])
    assert sanitize.main(["--files", TWO_FILES, "--skip", str(tmp_path / "none.json")]) == 2
    assert "--skip: cannot read" in capsys.readouterr().err
