"""make sanitize (gpullm_lessons/sanitize.py) without a GPU: a stand-in compute-sanitizer shows that a part is
reported clean only when the sanitizer counted no error and the tests passed, and that every other outcome (errors
in one of several processes, failed tests, no summary, a hang) makes the run fail with the part named."""

import os
import stat

import pytest

from gpullm_lessons import sanitize


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
