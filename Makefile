# gpullm-lessons: every command a learner, an instructor or a lab admin needs.
# On a fresh machine the first target you run creates .venv and installs the course into it.
# Use your own environment instead (conda, an existing venv):  make test PY=python
# GPU servers: make setup GPU=cuda13   (or GPU=cuda12 for a CUDA 12 driver, GPU=rocm for AMD ROCm 7)

VENV   ?= .venv
PY     ?= $(VENV)/bin/python
GPU    ?=
comma  := ,
EXTRAS := dev$(if $(GPU),$(comma)$(GPU))
# Only build .venv when PY points into it.
SETUP  := $(if $(filter $(VENV)/bin/python,$(PY)),$(VENV)/.installed-$(EXTRAS),)
# One BLAS thread per process: tests and notebook kernels run side by side on small CI machines.
PYTEST := OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-1} $(PY) -m pytest -p no:cacheprovider
NBVAL  := --nbval-lax --nbval-current-env --nbval-cell-timeout=900
# The lessons go to nbval only where the browser test cannot run them (no Chromium, or no playwright in PY's env).
BROWSER_OR_NBVAL := $$(test -x "$${GPULLM_CHROMIUM:-/usr/bin/chromium}" && $(PY) -c "import playwright" 2>/dev/null || echo notebooks)
# make test: 2 pytest-xdist workers (CI has 2 cores). Each test file and each notebook is one unit of work, run in
# order by one worker; the MPI tests, the browser test and the lessons under nbval share one unit, run first
# (tests/conftest.py: ONE_AT_A_TIME). `make test XDIST=` runs the suite in one process.
XDIST  ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: help setup train test lint unit notebooks browser-test gpu-test sanitize strategies bench lab doctor image exercises grade grade-solutions clean clean-notebooks

help:
	@sed -n 's/^## //p' $(MAKEFILE_LIST)

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (gpullm-lessons)" >/dev/null
	touch $@

## setup       create .venv and install the course (GPU=cuda13|cuda12|rocm adds CuPy)
setup: $(SETUP)

## train       the main job: train the GPT on the default corpus (ARGS="--steps 500 ..." to change it)
train: $(SETUP)
	$(PY) -m gpullm_lessons.train $(ARGS)

## test        unit tests + every lesson run in JupyterLab in headless Chromium + every solution run and graded
# The lessons of notebooks/ run in the browser test (tests/test_browser.py) instead of under nbval: it runs every
# cell too and also checks what a learner sees (figures, widgets, stderr); running them twice would cost CI minutes.
# The solutions run once, in the grader (tests/test_repo_notebooks.py): every cell, no error, every task correct
# (`make notebooks` runs them under nbval as well).
# Without Chromium the browser test skips and the lessons run under nbval (CI sets GPULLM_REQUIRE_BROWSER=1: fails).
test: lint
	$(PYTEST) -q --durations=25 $(XDIST) $(NBVAL) tests $(BROWSER_OR_NBVAL)

## lint        ruff: the linter over the package, kernels, tests and lab/; the formatter's check over RUFF_FORMATTED
# (the modules formatted with `ruff format` so far; a module joins the list when it is next reworked, so that a
# formatting-only diff never hides a change of the code the lessons print)
RUFF_FORMATTED := gpullm_lessons/engine gpullm_lessons/parallel gpullm_lessons/viz gpullm_lessons/contracts \
	gpullm_lessons/backends gpullm_lessons/checks/verdict.py gpullm_lessons/bench/timing.py tests/test_train_ranks.py tests/test_containers.py \
	tests/test_import_graph.py tests/test_kernel_names.py gpullm_lessons/bench/sanitize.py tests/test_sanitize.py tests/test_viz.py tests/test_checks_verdict.py \
	tests/test_slurm.py tests/test_slurm_env.py
RUFF_FORMATTED += gpullm_lessons/classroom/gradebook.py tests/test_class.py
RUFF_FORMATTED += tests/test_checkpointing_sqrt.py
RUFF_FORMATTED += gpullm_lessons/runtime/blaslt.py tests/test_blaslt.py
RUFF_FORMATTED += gpullm_lessons/runtime/sm90.py tests/test_sm90.py
RUFF_FORMATTED += gpullm_lessons/reference/head.py tests/test_ce_chunks.py
RUFF_FORMATTED += gpullm_lessons/bench/gpu_suite.py tests/test_gpu_suite.py tests/test_flash_launch_args.py gpullm_lessons/checks/borrowed.py \
	tests/test_borrowed.py tests/test_wheel_class.py
RUFF_FORMATTED += tests/test_optimizer_state_bf16.py tests/test_optimizer_state_int8.py tests/test_offload.py
RUFF_FORMATTED += lab/jupyterhub tests/test_jupyterhub.py
RUFF_FORMATTED += tests/test_pipeline.py tests/test_pipeline_ranks.py
RUFF_FORMATTED += tests/test_ring_attention.py tests/test_ring_attention_ranks.py
RUFF_FORMATTED += tests/test_zero3.py tests/test_zero3_ranks.py tests/test_zeropp.py tests/test_zeropp_ranks.py
RUFF_FORMATTED += tests/test_tensor_parallel.py tests/test_tensor_parallel_ranks.py tests/test_plan.py tests/test_ulysses.py tests/test_ulysses_ranks.py
RUFF_FORMATTED += gpullm_lessons/checks/beyond.py tests/test_tasks_13.py tests/test_course_check.py
lint: $(SETUP)
	$(PY) -m ruff check gpullm_lessons kernels tests lab
	$(PY) -m ruff format --check $(RUFF_FORMATTED)

## unit        unit tests only (fast; no browser)
unit: $(SETUP)
	$(PYTEST) -q -m "not browser" tests

## browser-test  every lesson and one exercise in JupyterLab + headless Chromium: Run All, then errors, figures,
##               widgets (needs /usr/bin/chromium: apt-get install chromium); screenshots in runs/browser/
##               (make test takes one only of a notebook that fails)
browser-test: $(SETUP)
	GPULLM_BROWSER_SHOTS=1 $(PYTEST) -q -m browser tests/test_browser.py

## notebooks   lesson and solution notebooks under nbval only
notebooks: $(SETUP)
	$(PYTEST) -q $(NBVAL) notebooks solutions

## gpu-test    the whole GPU suite on a lab server, in one run: every test (GPU-marked included), every lesson and
##              every solution at GPU sizes, in parallel processes over the one GPU (fails without a GPU); writes
##              runs/gpu-test/summary.json and one line per failure (ARGS="--workers 8" or ARGS="-- -k flash")
gpu-test: $(SETUP)
	$(PY) -m gpullm_lessons.bench.gpu_suite $(ARGS)

## strategies  lesson 13's five strategies on the course preset, 2 and 4 CPU ranks against one rank (MPI; minutes):
##              losses and memory per rank within their tolerances, or a refusal that says why (parallel/course_check.py)
strategies: $(SETUP)
	OPENBLAS_NUM_THREADS=1 $(PY) -m gpullm_lessons.parallel.course_check --json runs/strategies_course.json $(ARGS)

## sanitize    NVIDIA GPU: the kernel tests under compute-sanitizer (memcheck, racecheck), one test file per part
##              (ARGS="--tools initcheck --files tests/test_hip_flash.py"; --jobs, --chunk, --shard, --out: see bench/sanitize.py)
sanitize: $(SETUP)
	$(PY) -c "from gpullm_lessons import device; device.require_gpu('make sanitize')"
	$(PY) -m gpullm_lessons.bench.sanitize $(ARGS)

## bench       GPU: every kernel version beside PyTorch -> runs/bench_kernels.json and runs/roofline.png
bench: $(SETUP)
	mkdir -p runs
	$(PY) -m gpullm_lessons.bench kernels --json runs/bench_kernels.json --plot runs/roofline.png

## lab         open the lessons in JupyterLab
lab: $(SETUP)
	$(PY) -m jupyter lab notebooks

## doctor      check this machine and say how to fix what is missing
doctor: $(SETUP)
	$(PY) -m gpullm_lessons doctor

## image       lab servers: the course's Docker image (GPU=cuda13, the default, or GPU=rocm; lab/containers/README.md)
IMAGE_GPU = $(or $(GPU),$(shell sed -n 's/^ARG GPU=//p' lab/containers/Dockerfile))
image:
	@case " $(shell sed -n 's/^FROM .* AS base-//p' lab/containers/Dockerfile) " in *" $(IMAGE_GPU) "*) ;; \
	*) echo "make image: lab/containers/Dockerfile has no image for GPU=$(IMAGE_GPU) (it has:" \
	   "$(shell sed -n 's/^FROM .* AS base-//p' lab/containers/Dockerfile))" >&2; exit 2;; esac
	@cmd="docker build -f lab/containers/Dockerfile --build-arg GPU=$(IMAGE_GPU) -t gpullm-lessons:$(IMAGE_GPU) ."; \
	if command -v docker >/dev/null 2>&1; then echo "$$cmd" && $$cmd; \
	else echo "make image: docker not found; on a machine with Docker, from this folder: $$cmd" >&2; exit 1; fi

## exercises   regenerate exercises/ from solutions/ (never edit exercises/ by hand)
exercises: $(SETUP)
	$(PY) -m gpullm_lessons exercises

## grade       grade your exercises: runs each notebook in exercises/ and prints a score table
grade: $(SETUP)
	$(PY) -m gpullm_lessons grade exercises --json runs/grade.json

## grade-solutions  instructors: the solutions must score 100%
grade-solutions: $(SETUP)
	$(PY) -m gpullm_lessons grade solutions

## clean       remove runs/ and caches (keeps .venv)
clean:
	rm -rf runs build dist *.egg-info .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

## clean-notebooks  strip outputs and odd metadata from notebooks/ and solutions/ (tests require it)
clean-notebooks: $(SETUP)
	$(PY) -c "import sys, glob; from gpullm_lessons.classroom.exercises import strip_outputs; [print('cleaned', p) for p in sorted(glob.glob('notebooks/*.ipynb') + glob.glob('solutions/*.ipynb')) if strip_outputs(p)]"
