"""The student's path in a real JupyterLab, driven in a headless Chromium.

Batch runs (nbval, papermill, the grader) get the launcher's output grouped in rank order; a student
in JupyterLab gets it live, presses ■, moves sliders and restarts kernels. These tests do that:
1. run all of lesson 00 and find every output the stored notebook shows, and no stderr or error;
2. see a launch's lines arrive while its cell still runs;
3. press ■ during a launch: the launcher's message, no rank left, the next launch works;
4. move a slider in lesson 03 and see its output change;
5. restart the kernel during a launch: no process of that launch left.
Each step saves a screenshot in build/browser/. Skipped without Chromium (the skip says how to get
it); COURSE_REQUIRE_BROWSER=1 (set by .ci/run) makes that a failure. COURSE_BROWSER picks the executable.
"""
import configparser
import os
import re
import shutil
import sys
import time

import nbformat
import pytest

from browser import JupyterLab, Notebook
from pidwatch import alive, wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOTS = os.path.join(REPO, "build", "browser")
LESSON_00 = "lessons/00_launching.ipynb"
LESSON_03 = "lessons/03_allreduce_from_scratch.ipynb"


@pytest.fixture(scope="module")
def lab(browser, tmp_path_factory):
    """JupyterLab serving a copy of the course's lessons from a folder under pytest's tmp_path
    (the path says "pytest": output must stay live there all the same)."""
    root = tmp_path_factory.mktemp("course")
    shutil.copytree(os.path.join(REPO, "lessons"), root / "lessons",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    nbformat.write(scratch_notebook(), root / "lessons" / "student.ipynb")
    server = JupyterLab(root, tmp_path_factory.mktemp("jupyter"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        left = [p.pid for p in server.processes.values() if alive(p.pid)]
        assert not left, f"processes left after stopping JupyterLab: {left}"


@pytest.fixture(scope="module")
def context(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(60_000)
    try:
        yield context
    finally:
        context.close()


# ---------------------------------------------------------------- the notebook a student types into

PID_FOLDER = "pids"   # next to the notebook: ranks write their pids there

SCRATCH_CELLS = [
    # 0
    "import os, time\nimport torch.distributed as dist\nimport utils\n"
    f"os.makedirs('{PID_FOLDER}', exist_ok=True)",
    # 1: live output
    "def slow_talk():\n"
    "    for i in range(4):\n"
    "        print(f'tick {i}')\n"
    "        time.sleep(1.0)\n"
    "    return dist.get_rank()\n"
    "utils.launch(slow_talk, world_size=2)",
    # 2: a long launch, to be stopped with ■ or a kernel restart
    "def wait_long(folder):\n"
    "    with open(f'{folder}/rank-{dist.get_rank()}', 'w') as f:\n"
    "        f.write(f'{os.getpid()} {os.getppid()}')   # the rank and the forkserver it came from\n"
    "    print('waiting')\n"
    "    time.sleep(600)\n"
    f"folder = f'{PID_FOLDER}/{{time.time_ns()}}'\n"
    "os.makedirs(folder)\n"
    "utils.launch(wait_long, folder, world_size=3, timeout=900)",
    # 3: the next launch in the same kernel
    "print('next launch:', utils.launch(lambda: dist.get_rank() * 10, world_size=3))",
]


def scratch_notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in SCRATCH_CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def launches(root):
    """The pid folders of the long launches so far."""
    return set(os.listdir(os.path.join(root, "lessons", PID_FOLDER)))


def rank_pids(notebook, root, before, expected=3):
    """(rank pids, forkserver pids) of the long launch started after `before`, once all its ranks wrote theirs."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        new = launches(root) - before
        if new:
            folder = os.path.join(root, "lessons", PID_FOLDER, new.pop())
            texts = [open(os.path.join(folder, n)).read().split() for n in os.listdir(folder)]
            if len(texts) == expected and all(len(t) == 2 for t in texts):
                return [int(t[0]) for t in texts], {int(t[1]) for t in texts}
        time.sleep(0.1)
    raise AssertionError(f"the ranks of the long launch did not write their pids: {notebook.outputs(2)}")


@pytest.fixture(scope="module")
def scratch(context, lab):
    notebook = Notebook(context, lab, "lessons/student.ipynb", "student", SHOTS)
    notebook.run_cell(0)
    notebook.wait_idle()
    yield notebook
    notebook.page.close()


# ---------------------------------------------------------------- the steps

def test_notebooks_name_a_kernel_of_this_environment(monkeypatch):
    """`make lab` (JUPYTER_PATH = this environment's share/jupyter) finds the kernel every notebook names, and
    it runs this environment's Python. No browser needed."""
    from jupyter_client.kernelspec import KernelSpecManager
    monkeypatch.setenv("JUPYTER_PATH", os.path.join(sys.prefix, "share", "jupyter"))
    names = {nbformat.read(os.path.join(REPO, folder, name), as_version=4).metadata.kernelspec.name
             for folder in ("lessons", "labs") for name in os.listdir(os.path.join(REPO, folder))
             if name.endswith(".ipynb")}
    for name in names:
        spec = KernelSpecManager().get_kernel_spec(name)
        assert spec.resource_dir.startswith(sys.prefix), (name, spec.resource_dir)
        assert spec.argv[0] in ("python", "python3", sys.executable), spec.argv



def sanitizers():
    config = configparser.ConfigParser(interpolation=None)
    config.read(os.path.join(REPO, "tests", "sanitize.cfg"))
    return [(re.compile(config[s]["regex"]), config[s]["replace"]) for s in config.sections()]


def stored_lines(cell, rules):
    """The non-empty lines a stored code cell shows as text (stdout, text/plain results)."""
    text = ""
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            text += out["text"]
        elif "text/plain" in out.get("data", {}) and "image/png" not in out["data"] \
                and "application/vnd.jupyter.widget-view+json" not in out["data"]:
            text += out["data"]["text/plain"] + "\n"
    return [sanitize(line, rules) for line in text.splitlines() if line.strip()]


def sanitize(text, rules):
    for regex, replace in rules:
        text = regex.sub(replace, text)
    return text.strip()


def test_1_lesson_00_runs_and_shows_what_it_promises(context, lab):
    stored = nbformat.read(os.path.join(REPO, LESSON_00), as_version=4)
    notebook = Notebook(context, lab, LESSON_00, "lesson00", SHOTS)
    start = time.monotonic()
    notebook.command("notebook:run-all-cells")
    notebook.wait_idle(limit=240)
    seconds = time.monotonic() - start
    outputs, rules = notebook.outputs(), sanitizers()
    assert len(outputs) == len(stored.cells)
    missing = {}
    for index, (cell, shown) in enumerate(zip(stored.cells, outputs)):
        if cell.cell_type != "code" or cell.source.startswith("# NBVAL_IGNORE_OUTPUT"):
            continue
        page_lines = {sanitize(line, rules) for line in shown.splitlines()}
        lost = [line for line in stored_lines(cell, rules) if line not in page_lines]
        if lost:
            missing[index] = lost
    notebook.screenshot("1_lesson00_ranks.png", cell=4)
    notebook.screenshot("1_lesson00_failure_report.png", cell=next(
        i for i, c in enumerate(stored.cells) if "def mismatched_shapes" in c.source))
    assert not missing, f"outputs of the stored notebook not shown in the browser (cell: lines): {missing}"
    assert not notebook.stderr_outputs(), f"stderr or errors in the page: {notebook.stderr_outputs()}"
    text = "".join(outputs)
    for promised in ["[rank 3] I am rank 3 of 4", "✓ every rank holds the sum", "launch timed out after",
                     "rank 0 was killed by signal SIGABRT", "what():"]:
        assert promised in text
    assert seconds < 180, f"lesson 00 took {seconds:.0f} s in the browser"
    notebook.page.close()


def test_2_output_arrives_while_the_cell_runs(scratch):
    scratch.run_cell(1)
    scratch.wait_for_text(1, "[rank 0] tick 0")
    shown = scratch.outputs(1)
    running = scratch.is_running(1)
    scratch.screenshot("2_live_output.png", cell=1)
    assert running, "the first lines appeared only after the cell finished"
    assert "tick 3" not in shown, f"everything arrived at once: {shown!r}"
    scratch.wait_idle()
    lines = scratch.outputs(1)
    for rank in (0, 1):
        for i in range(4):
            assert f"[rank {rank}] tick {i}" in lines
    assert "[0, 1]" in lines   # the cell's value: what each rank returned


def test_3_stop_button_stops_every_rank(scratch, lab):
    before = launches(lab.root)
    scratch.run_cell(2)
    ranks, forkservers = rank_pids(scratch, lab.root, before)
    scratch.wait_for_text(2, "waiting")
    start = time.monotonic()
    scratch.toolbar_button("notebook:interrupt-kernel").click()
    scratch.wait_for_text(2, "Interrupted: stopped all 3 ranks.", limit=30)
    seconds = time.monotonic() - start
    left = wait_gone(ranks, seconds=5)
    scratch.wait_idle()
    scratch.screenshot("3_stop_button.png", cell=2)
    assert not left, f"ranks still running after ■: {left}"
    assert seconds < 10, f"■ took {seconds:.1f} s to stop the launch"
    report = scratch.outputs(2)
    assert "KeyboardInterrupt" in report
    assert "_wait" not in report and "selector" not in report, "the launcher's internals in the traceback"
    scratch.run_cell(3)
    scratch.wait_idle()
    assert "next launch: [0, 10, 20]" in scratch.outputs(3)
    assert all(alive(p) for p in forkservers), "the forkserver should survive ■ (the kernel lives on)"


def test_4_a_slider_redraws_its_output(context, lab):
    stored = nbformat.read(os.path.join(REPO, LESSON_03), as_version=4)
    calculator = next(i for i, c in enumerate(stored.cells) if "def calculator_html" in c.source)
    needed = [1, 2, 3] + [i for i, c in enumerate(stored.cells) if "def ring_volume_per_gpu" in c.source]
    notebook = Notebook(context, lab, LESSON_03, "lesson03", SHOTS)
    for index in needed + [calculator]:
        notebook.run_cell(index)
        notebook.wait_idle()
    cell = notebook.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").nth(calculator)
    slider = cell.locator(".widget-slider", has_text="GPUs N")
    answer = cell.locator(".widget-html-content")
    before = answer.text_content()
    slider.locator(".noUi-handle").focus()
    for _ in range(3):
        notebook.page.keyboard.press("ArrowRight")
    # 8 → 11 GPUs: each sends 2·(N−1)/N · 14 GB, 24.50 GB before, 25.45 GB after
    notebook.page.wait_for_function("(el) => el.textContent.includes('each GPU sends 25.45 GB')",
                                    arg=answer.element_handle(), timeout=15_000)
    notebook.screenshot("4_slider.png", cell=calculator)
    assert "each GPU sends 24.50 GB" in before, before
    assert slider.locator(".widget-readout").text_content().strip() == "11"
    notebook.page.close()


def test_5_kernel_restart_during_a_launch_leaves_no_process(scratch, lab):
    old_kernel = scratch.kernel_id()
    before = launches(lab.root)
    scratch.run_cell(2)
    ranks, forkservers = rank_pids(scratch, lab.root, before)
    scratch.toolbar_button("notebook:restart-kernel").click()
    scratch.page.locator(".jp-Dialog .jp-mod-accept").click()
    start = time.monotonic()
    left = wait_gone(ranks + sorted(forkservers), seconds=10)
    seconds = time.monotonic() - start
    scratch.page.wait_for_function(
        f"() => {scratch._panel}.sessionContext.session?.kernel?.status === 'idle'", timeout=60_000)
    scratch.screenshot("5_kernel_restart.png", cell=2)
    assert not left, f"processes of the launch left after the kernel restart: {left}"
    assert seconds < 10
    assert scratch.kernel_id() == old_kernel   # a restart keeps the kernel's id, with a new process
