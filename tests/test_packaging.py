"""Packaging: a non-editable install ships kernels/, cupy stays optional, environment.yml agrees with pyproject.toml."""
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _spec(req: str) -> str:
    req = re.sub(r"\[[^\]]*\]", "", req.strip())
    return req[len(_name(req)):].replace(" ", "")


def build_wheel(tmp: Path) -> Path:
    """The course's wheel, built from a copy of the checkout under tmp: setuptools writes build/ and *.egg-info into
    the folder it builds, and no test writes into the checkout (tests/test_slurm.py checks that a job wrote nothing
    there, while this may run on the other worker; two builds at once would share one build/)."""
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "runs", "*.egg-info",
                                                             "__pycache__", ".whl", "node_modules", ".nvm"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (whl,) = (tmp / "dist").glob("gpullm_lessons-*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_ships_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"gpullm_lessons/kernels/hip/{p.name}" for p in (ROOT / "kernels" / "hip").iterdir()
                if p.suffix in (".cu", ".h")}
    expected |= {f"gpullm_lessons/kernels/numba/{p.name}" for p in (ROOT / "kernels" / "numba").glob("*.py")}
    expected |= {f"gpullm_lessons/kernels/sm90/{p.name}" for p in (ROOT / "kernels" / "sm90").iterdir()
                 if p.suffix in (".cu", ".h")}
    assert expected and expected <= names, sorted(expected - names)


def test_every_package_folder_is_listed_and_shipped(wheel):
    """pyproject lists its packages by name: a new package folder left out would be missing from a non-editable
    install (and every import of it would fail there)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(("gpullm_lessons",) + p.parent.relative_to(ROOT / "gpullm_lessons").parts)
               for p in (ROOT / "gpullm_lessons").rglob("__init__.py")}
    on_disk |= {".".join(("gpullm_lessons", "kernels") + p.parent.relative_to(ROOT / "kernels").parts)
                for p in (ROOT / "kernels").rglob("__init__.py")}
    assert on_disk - listed == set(), f"package folders missing from pyproject's packages: {sorted(on_disk - listed)}"
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in sorted(listed - DATA_ONLY):
        folder = pkg.replace("gpullm_lessons.kernels", "gpullm_lessons/kernels").replace(".", "/")
        assert f"{folder}/__init__.py" in names, f"{pkg} is not in the wheel"


DATA_ONLY = {"gpullm_lessons.course_exercises"}  # folders of data the wheel carries, no Python


def test_wheel_ships_the_exercises_byte_for_byte(wheel):
    """The grader's task list and `start`'s copies in an installed course: exercises/ as it is in the checkout."""
    z = zipfile.ZipFile(wheel)
    shipped = {n.rsplit("/", 1)[1]: z.read(n) for n in z.namelist() if n.startswith("gpullm_lessons/course_exercises/")}
    here = {p.name: p.read_bytes() for p in (ROOT / "exercises").glob("*.ipynb")}
    assert here and shipped == here, sorted(set(here) ^ set(shipped))


def test_installed_package_finds_its_kernels(wheel, tmp_path):
    target = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    code = ("import gpullm_lessons, gpullm_lessons.runtime.hip as h; import gpullm_lessons.kernels.numba.vector_add;"
            "print(h.kernel_dir()); print(len(h.sources())); print('#include \"portable.h\"' not in h.expanded_source('vector_add'))")
    env = dict(os.environ, PYTHONPATH=str(target), GPULLM_DEVICE="sim")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    kdir, count, expanded = p.stdout.split()
    assert kdir.startswith(str(target)), "the installed copy must be used, not the checkout"
    assert int(count) == len(list((ROOT / "kernels" / "hip").glob("*.cu")))
    assert expanded == "True"


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    in_env = {_name(r): _spec(r) for r in conda + pip if not r.startswith("-") and _name(r) not in ("python", "pip")}
    in_project = {_name(r): _spec(r) for r in project["dependencies"]}
    assert in_env == in_project
    assert any(r.startswith("-e .") for r in pip), "environment.yml must install the course itself"


def test_cupy_is_only_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(_name(r).startswith("cupy") for r in project["dependencies"])
    extras = project["optional-dependencies"]
    assert {"cuda12", "cuda13", "rocm", "dev"} <= set(extras)
    assert any(_name(r) == "cupy-cuda13x" for r in extras["cuda13"])
    assert any(_name(r) == "cupy-cuda12x" for r in extras["cuda12"])
    assert any(_name(r).startswith("cupy-rocm") for r in extras["rocm"])
    assert any(_name(r) == "numpy" and "<2.5" in _spec(r) for r in project["dependencies"])
