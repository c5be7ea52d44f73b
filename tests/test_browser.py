"""Every lesson in a real browser: JupyterLab + headless Chromium (Playwright), Run All Cells from the menu.

For each notebook in notebooks/ (and one exercise notebook) the test opens it in JupyterLab, runs every cell from
the UI, waits until the kernel is idle and every code cell has an execution count, and fails, naming the notebook
and the cell, on what a learner would see as broken:

- an error output (a traceback) or any other text on stderr (a pink box: warnings, progress noise, a device line);
- a figure that did not render (an <img> output with naturalWidth 0);
- a widget that shows "Error displaying widget", stays "Loading widget..." or is drawn as ipywidgets' error box;
- lesson 07's float-formats widget not answering: a value typed into its text box must move the slider and change
  the table, a dragged slider must change the text box and the table.

The exercise notebook (exercises/00_gpu_orientation) runs with its TODO cells unwritten: its checker cells must say
*not attempted* and nothing else may fail (no traceback at all: the checkers catch NotImplementedError).

report.txt in runs/browser/ gives Run All's time per notebook and the printed lines wider than 100 characters (which
JupyterLab wraps anywhere). A notebook that fails leaves a screenshot of itself there; with GPULLM_BROWSER_SHOTS=1
(`make browser-test` sets it) every notebook does. The pictures are a help, not a verdict: taking them scrolls the
whole notebook a window at a time, about 10 s a lesson, which `make test` saves. Needs /usr/bin/chromium (Debian's
`chromium` package) and the `playwright` package (the `dev` extra); `playwright install` is never needed. Run it with
`make browser-test` (or `pytest -m browser tests/test_browser.py`). `make test` runs it instead of nbval over
notebooks/ (nbval still runs solutions/); without Chromium it skips there and the lessons go to nbval, except on CI
(GPULLM_REQUIRE_BROWSER=1), where a missing browser fails.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("GPULLM_CHROMIUM", "/usr/bin/chromium")
SHOTS = ROOT / "runs" / "browser"
SHOT_ALWAYS = os.environ.get("GPULLM_BROWSER_SHOTS") == "1"   # a screenshot of every notebook, not only of a failure
LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
EXERCISE = "00_gpu_orientation.ipynb"

SERVER_START_S = 120      # JupyterLab answering
OPEN_S = 120              # the notebook rendered and its kernel idle
RUN_S = 900               # one notebook's Run All (the slowest lesson takes a few minutes on 2 cores)
WIDGET_S = 30             # a widget answering a change

pytestmark = pytest.mark.browser


def _skip_or_fail(msg: str):
    """Missing browser pieces: a failure on CI (GPULLM_REQUIRE_BROWSER=1, set by .ci/run), a skip elsewhere."""
    if os.environ.get("GPULLM_REQUIRE_BROWSER") == "1":
        pytest.fail("GPULLM_REQUIRE_BROWSER=1 but " + msg)
    pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """In the child: get SIGTERM when the test process dies, so a killed test run leaves no server behind (Linux)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:
        pass


def _settings(directory: Path):
    """User settings for a test run: every cell rendered (no windowing, so each output is in the DOM), no autosave,
    no news or update pop-ups."""
    def put(plugin: str, values: dict):
        path = directory / (plugin.split(":")[0]) / (plugin.split(":")[1] + ".jupyterlab-settings")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    put("@jupyterlab/notebook-extension:tracker", {"windowingMode": "none"})
    put("@jupyterlab/docmanager-extension:plugin", {"autosave": False})
    put("@jupyterlab/apputils-extension:notification", {"fetchNews": "false", "checkForUpdates": False})


class Lab:
    """A JupyterLab server on 127.0.0.1, a random port and token, over a temporary copy of the notebooks."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.root = tmp / "root"
        for folder, names in (("notebooks", LESSONS), ("exercises", [EXERCISE])):
            (self.root / folder).mkdir(parents=True)
            for name in names:
                shutil.copy(ROOT / folder / name, self.root / folder / name)
        _settings(tmp / "settings")
        self.port, self.token = _free_port(), secrets.token_hex(16)
        env = dict(os.environ)
        env.update(GPULLM_DEVICE="sim",                   # CI's setting: Numba kernels in the CUDA simulator
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_CONFIG_DIR=str(tmp / "config"),
                   JUPYTER_DATA_DIR=str(tmp / "data"), IPYTHONDIR=str(tmp / "ipython"),
                   MPLCONFIGDIR=str(tmp / "mpl"), JUPYTER_PLATFORM_DIRS="1",
                   OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
        env.pop("MPLBACKEND", None)
        env.pop("DISPLAY", None)
        # sys.executable is .venv's python: its `python3` kernelspec (installed with --sys-prefix) is the kernel used
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               f"--LabApp.user_settings_dir={tmp / 'settings'}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
               "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--MappingKernelManager.cull_idle_timeout=0", "--KernelSpecManager.ensure_native_kernel=False"]
        self.log = open(tmp / "jupyter.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                self.api("status")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.close()
                    raise RuntimeError(f"JupyterLab did not start:\n{tail}")
                time.sleep(0.5)
        spec = self.api("kernelspecs")["kernelspecs"]["python3"]["spec"]
        # the kernel is this environment's python (.venv's under make): not some other python3 on the machine
        if Path(spec["argv"][0]).parent != Path(sys.executable).parent:
            self.close()
            raise RuntimeError(f"the python3 kernelspec runs {spec['argv'][0]}, not {sys.executable}: "
                               f"`{sys.executable} -m ipykernel install --sys-prefix --name python3` (make setup)")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self):
        for k in self.api("kernels"):
            self.api(f"kernels/{k['id']}", method="DELETE")

    def log_tail(self, n: int = 3000) -> str:
        self.log.flush()
        return (self.tmp / "jupyter.log").read_text(errors="replace")[-n:]

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        _skip_or_fail(f"{CHROMIUM} not found (Debian: apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        _skip_or_fail("playwright is not installed (pip install -e '.[dev]')")
    (SHOTS / "report.txt").unlink(missing_ok=True)
    server = Lab(tmp_path_factory.mktemp("lab"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        yield b
        b.close()


# ---- driving JupyterLab --------------------------------------------------------------------------------------------

def _cells_state(page) -> list:
    """Per cell of the notebook panel, in order: its kind, prompt, text outputs by mime type, broken images, widget
    placeholder texts."""
    return page.evaluate("""() => {
      const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
      if (!nb) return null;
      return [...nb.querySelectorAll(':scope .jp-Cell')].map(cell => {
        const code = cell.classList.contains('jp-CodeCell');
        const prompt = code ? (cell.querySelector('.jp-InputArea-prompt')?.textContent || '').trim() : '';
        const outs = [...cell.querySelectorAll('.jp-OutputArea-output')];
        const stderr = outs.filter(o => o.matches('[data-mime-type="application/vnd.jupyter.stderr"]'))
                           .map(o => o.innerText);
        const imgs = [...cell.querySelectorAll('.jp-OutputArea-output img')]
                       .map(i => ({complete: i.complete, w: i.naturalWidth, src: (i.src || '').slice(0, 40)}));
        const text = outs.map(o => o.innerText).join('\\n');
        const streams = outs.filter(o => o.matches('[data-mime-type="application/vnd.jupyter.stdout"]'))
                            .map(o => o.innerText);
        // ipywidgets 8 draws a widget whose view failed as an error box ("Click to show javascript error.")
        const widgetErrors = [...cell.querySelectorAll('.jupyter-widgets-error-widget')].map(e => e.innerText);
        return {code, prompt, stderr, imgs, text, streams, widgetErrors,
                widgets: cell.querySelectorAll('.jp-OutputArea-output .widget-box, .jupyter-widgets').length};
      });
    }""")


def _open(page, lab, path: str):
    """Open `path` in a workspace of its own (nothing restored from an earlier notebook) and wait until its one
    kernel is started, connected and idle."""
    workspace = "t" + secrets.token_hex(4)
    page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{path}?token={lab.token}", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=OPEN_S * 1000)
    deadline, seen, since = time.monotonic() + OPEN_S, None, 0.0
    while True:
        kernels = [s["kernel"] for s in lab.api("sessions") if s["path"] == path and s.get("kernel")]
        ids = tuple(k["id"] for k in kernels)
        ready = page.evaluate("""() => {
            const s = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');
            return !!s && s.getAttribute('data-status') === 'idle'; }""")
        if len(ids) == 1 and kernels[0]["execution_state"] == "idle" and ready:
            if ids != seen:
                seen, since = ids, time.monotonic()
            elif time.monotonic() - since > 2.0:   # the same kernel for 2 s: no restart or switch under way
                return
        else:
            seen = None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: the kernel was not ready after {OPEN_S} s (sessions: {kernels})")
        time.sleep(0.5)


def _run_all(page):
    """Run > Run All Cells, from the menu bar."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def _wait_done(page, lab, timeout_s: float):
    """Until the kernel is idle and no cell waits ([*]); then every code cell should have a number (a cell that
    raised stops Run All: the cells after it keep an empty prompt, and _problems names them)."""
    deadline = time.monotonic() + timeout_s
    stalled = None
    time.sleep(1.0)
    while True:
        state = _cells_state(page)
        kernels = lab.api("kernels")
        idle = bool(kernels) and all(k["execution_state"] == "idle" for k in kernels)
        prompts = [c["prompt"] for c in state if c["code"]]
        waiting = any("*" in p for p in prompts)
        if idle and not waiting:
            # let the last outputs render: images, and widget views (up to WIDGET_S for "Loading widget...")
            time.sleep(1.5)
            until = time.monotonic() + WIDGET_S
            while any("Loading widget..." in c["text"] for c in _cells_state(page)) and time.monotonic() < until:
                time.sleep(0.5)
            return _cells_state(page)
        # queued cells while the kernel has been idle for 60 s: the requests were lost, waiting longer won't help
        stalled = (stalled or time.monotonic()) if idle and waiting else None
        if stalled and time.monotonic() - stalled > 60:
            raise TimeoutError(f"Run All stalled: the kernel is idle but cells still wait: {prompts}")
        if time.monotonic() > deadline:
            pending = [i for i, c in enumerate(state) if c["code"] and not re.fullmatch(r"\[\d+\]:", c["prompt"])]
            raise TimeoutError(f"not done after {timeout_s:.0f} s (kernel idle: {idle}); cells without a count: "
                               f"{pending[:10]}")
        time.sleep(2.0)


def _source_heads(folder: str, name: str) -> list:
    import nbformat
    nb = nbformat.read(ROOT / folder / name, as_version=4)
    return [(c.get("id", "?"), (c.source.strip().splitlines() or [""])[0][:70]) for c in nb.cells]


def _problems(name: str, folder: str, state: list) -> list:
    """What a learner would see as broken, one line per problem, naming the notebook and the cell."""
    heads = _source_heads(folder, name)
    assert len(heads) == len(state), f"{folder}/{name}: {len(state)} cells in the browser, {len(heads)} in the file"
    out = []
    for i, (cell, (cid, head)) in enumerate(zip(state, heads)):
        where = f"{folder}/{name} cell {i} (id {cid}: {head!r})"
        if cell["code"] and not re.fullmatch(r"\[\d+\]:", cell["prompt"]):
            out.append(f"{where}: did not run (prompt {cell['prompt']!r})")
        for text in cell["stderr"]:
            kind = "error" if "Traceback" in text or "Error" in text.splitlines()[0] else "stderr output"
            out.append(f"{where}: {kind}: {text.strip()[:600]}")
        for img in cell["imgs"]:
            if not img["complete"] or img["w"] == 0:
                out.append(f"{where}: a figure did not render ({img})")
        for bad in ("Error displaying widget", "Loading widget..."):
            if bad in cell["text"]:
                out.append(f"{where}: widget shows {bad!r}")
        for text in cell["widgetErrors"]:
            out.append(f"{where}: a widget failed to display: {text.strip()[:300]!r}")
    return out


def _report(folder: str, name: str, state: list, took: float):
    """runs/browser/report.txt: Run All's time per notebook, and the printed lines wider than 100 characters
    (JupyterLab wraps them anywhere, even inside a number): to read, not a verdict."""
    heads = _source_heads(folder, name)
    wide = [(i, line) for i, cell in enumerate(state) for text in cell["streams"] for line in text.splitlines()
            if len(line) > 100]
    SHOTS.mkdir(parents=True, exist_ok=True)
    with open(SHOTS / "report.txt", "a") as f:
        f.write(f"{folder}/{name}: Run All {took:.0f} s, {len(wide)} printed lines over 100 characters\n")
        for i, line in wide:
            f.write(f"    cell {i} (id {heads[i][0]}), {len(line)} chars: {line[:120]}\n")


def _run_notebook(browser, lab, folder: str, name: str):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        _open(page, lab, f"{folder}/{name}")
        t0 = time.monotonic()
        _run_all(page)
        state = _wait_done(page, lab, RUN_S)
        took = time.monotonic() - t0
        if SHOT_ALWAYS:
            _full_height_shot(page, folder, name)
        _report(folder, name, state, took)
        return page, context, state, took
    except Exception:
        _full_height_shot(page, folder, name)
        context.close()
        raise


def _full_height_shot(page, folder: str, name: str):
    """One picture of the whole notebook in runs/browser/: the window made tall (up to 8000 px), the notebook
    scrolled a window at a time and the pieces stacked. A screenshot is a help, not a verdict: errors are ignored."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{folder}_{Path(name).stem}.png"
    scroller = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"
    try:
        from PIL import Image, ImageOps
        total = page.evaluate(f"() => document.querySelector('{scroller}').scrollHeight")
        page.set_viewport_size({"width": 1400, "height": int(min(total + 200, 8000))})
        time.sleep(0.5)
        box = page.locator(scroller).bounding_box()
        view = int(box["height"])
        pieces, top = [], 0
        while True:
            page.evaluate(f"(y) => document.querySelector('{scroller}').scrollTop = y", top)
            time.sleep(0.3)
            actual = page.evaluate(f"() => document.querySelector('{scroller}').scrollTop")
            shot = SHOTS / f".piece{len(pieces)}.png"
            page.screenshot(path=str(shot), clip=box, timeout=60_000)
            pieces.append((int(actual), Image.open(shot).convert("RGB")))
            shot.unlink()
            if actual + view >= total or len(pieces) > 40:
                break
            top = actual + view
        width = pieces[0][1].width
        scale = width / box["width"]                      # device pixels per CSS pixel
        canvas = Image.new("RGB", (width, int(min(total, pieces[-1][0] + view) * scale)), "white")
        for y, img in pieces:
            canvas.paste(img, (0, int(y * scale)))
        content = ImageOps.invert(canvas.convert("L")).getbbox()      # drop the blank scroll-past-end space
        if content:
            canvas = canvas.crop((0, 0, width, min(canvas.height, content[3] + 20)))
        canvas.save(path)
    except Exception:
        try:
            page.screenshot(path=str(path), timeout=60_000)
        except Exception:
            pass
    finally:
        try:
            page.set_viewport_size({"width": 1400, "height": 1000})
        except Exception:
            pass


# ---- the tests -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LESSONS)
def test_lesson_runs_in_the_browser(browser, lab, name):
    page, context, state, took = _run_notebook(browser, lab, "notebooks", name)
    try:
        problems = _problems(name, "notebooks", state)
        if name.startswith("07_"):
            problems += _check_formats_widget(page, state, name)
        if problems or (SHOT_ALWAYS and name.startswith("07_")):   # 07: the picture after the widget moved
            _full_height_shot(page, "notebooks", name)
        print(f"{name}: Run All took {took:.0f} s")
        assert not problems, "\n".join(problems)
    finally:
        context.close()
        lab.shutdown_kernels()


def test_exercise_runs_in_the_browser(browser, lab):
    """The exercise as handed out: the checker cells say 'not attempted', nothing raises, everything else runs."""
    page, context, state, took = _run_notebook(browser, lab, "exercises", EXERCISE)
    try:
        problems = _problems(EXERCISE, "exercises", state)
        verdicts = [c["text"] for c in state if c["code"] and "not attempted" in c["text"].lower()]
        if not verdicts:
            problems.append(f"exercises/{EXERCISE}: no checker cell says 'not attempted'")
        for i, c in enumerate(state):
            if c["code"] and re.search(r"\b(correct|wrong)\b", c["text"]) and "not attempted" not in c["text"]:
                problems.append(f"exercises/{EXERCISE} cell {i}: a verdict other than 'not attempted': "
                                f"{c['text'][:300]}")
        print(f"exercises/{EXERCISE}: Run All took {took:.0f} s")
        if problems:
            _full_height_shot(page, "exercises", EXERCISE)
        assert not problems, "\n".join(problems)
    finally:
        context.close()
        lab.shutdown_kernels()


# ---- lesson 07's float-formats widget ------------------------------------------------------------------------------

def _check_formats_widget(page, state, name) -> list:
    """Type a value into the widget's text box: the slider and the table follow. Drag the slider: the text box and
    the table follow. Returns the problems found."""
    idx = [i for i, c in enumerate(state) if c["code"] and c["widgets"]]
    where = f"notebooks/{name}"
    if not idx:
        return [f"{where}: no widget rendered (viz.float_formats_widget)"]
    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").nth(idx[0])
    where = f"{where} cell {idx[0]} (the float-formats widget)"
    box = cell.locator(".widget-text input").first
    handle = cell.locator(".noUi-handle").first
    readout = cell.locator(".widget-readout").first
    table = cell.locator(".widget-html-content").first
    problems = []

    def wait_for(predicate, what):
        deadline = time.monotonic() + WIDGET_S
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.25)
        problems.append(f"{where}: {what}")
        return False

    try:
        box.wait_for(timeout=WIDGET_S * 1000)
        before = table.inner_text()
        box.fill("2.5")
        box.press("Enter")
        wait_for(lambda: table.inner_text() != before and "2.5" in table.inner_text(),
                 "typing 2.5 into the text box did not change the table")
        wait_for(lambda: _float(readout.inner_text()) is not None and abs(_float(readout.inner_text()) - 0.40) < 0.03,
                 f"typing 2.5 did not move the slider to log10(2.5) = 0.40 (readout {readout.inner_text()!r})")

        before, box_before = table.inner_text(), box.input_value()
        hb = handle.bounding_box()
        page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
        page.mouse.down()
        page.mouse.move(hb["x"] + hb["width"] / 2 - 60, hb["y"] + hb["height"] / 2, steps=8)
        page.mouse.up()

        def agree():
            e, v = _float(readout.inner_text()), _float(box.input_value())
            return (e is not None and v is not None and v > 0 and abs(e - math.log10(v)) < 0.03
                    and box.input_value() != box_before)
        wait_for(agree, f"dragging the slider did not update the text box to 10^slider (readout "
                        f"{readout.inner_text()!r}, text box {box.input_value()!r})")
        wait_for(lambda: table.inner_text() != before, "dragging the slider did not change the table")
    except Exception as e:   # a missing element is a broken widget
        problems.append(f"{where}: {type(e).__name__}: {str(e)[:300]}")
    return problems


def _float(text: str):
    try:
        return float(text.strip().replace("\u2212", "-"))   # the slider's readout writes a Unicode minus
    except (TypeError, ValueError):
        return None
