"""Plumbing for tests/test_browser.py: a JupyterLab of the test's own, a headless Chromium, and the
few things a student does in the page (run cells, press ■, restart the kernel, read the outputs).

Everything listens on 127.0.0.1 only. The server runs in its own session with its own settings,
workspaces, runtime and config folders, and is stopped, with every process under it (kernels,
forkservers, ranks), by `JupyterLab.stop()`.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil

INSTALL_HINT = ("install Chromium (Debian: `apt-get install chromium`; elsewhere `.venv/bin/python -m "
                "playwright install chromium`), or point COURSE_BROWSER at a Chromium or Chrome executable")


def find_browser() -> str | None:
    """A Chromium-family executable that actually starts: $COURSE_BROWSER, the system's, or Playwright's."""
    candidates = [os.environ.get("COURSE_BROWSER")]
    # (Ubuntu's chromium-browser is a stub that asks for a snap: --version weeds such stubs out.)
    candidates += [shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome",
                                                   "google-chrome-stable")]
    try:
        from playwright.sync_api import sync_playwright
        with sync_playwright() as p:
            candidates.append(p.chromium.executable_path)  # where `playwright install chromium` puts it
    except Exception:  # noqa: BLE001 — playwright missing or broken: no candidate from it
        pass
    for path in filter(None, candidates):
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if version.returncode == 0 and re.search(r"(Chromium|Chrome) \d+", version.stdout):
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_settings(folder):
    """JupyterLab user settings: every cell rendered (off-screen outputs keep their text), no news
    popup, no update check, no autosave (the test's edits never reach a file)."""
    settings = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                            "checkForUpdates": False},
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    }
    for name, value in settings.items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(value, f)


class JupyterLab:
    """`python -m jupyterlab` from this environment, serving `root` on a free loopback port."""

    def __init__(self, root, scratch):
        self.root, self.port, self.token = str(root), free_port(), secrets.token_hex(16)
        dirs = {name: os.path.join(scratch, name) for name in ("settings", "workspaces", "runtime", "config", "data")}
        for folder in dirs.values():
            os.makedirs(folder, exist_ok=True)
        write_settings(dirs["settings"])
        env = {k: v for k, v in os.environ.items() if k != "COURSE_OUTPUT"}  # the course decides live/grouped
        env.update(JUPYTER_RUNTIME_DIR=dirs["runtime"], JUPYTER_CONFIG_DIR=dirs["config"],
                   JUPYTER_DATA_DIR=dirs["data"], PYTHONUNBUFFERED="1")
        # the kernels' temporary files in a private folder, removed by stop(): a kernel stopped by killing its
        # process group takes its forkserver with it, and multiprocessing's pymp-* folder stayed in /tmp
        from utils.tools.kernels import socket_folder
        self.temp = socket_folder()
        env["TMPDIR"] = str(self.temp)
        self.log = open(os.path.join(scratch, "jupyterlab.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             f"--LabApp.user_settings_dir={dirs['settings']}", f"--LabApp.workspaces_dir={dirs['workspaces']}",
             "--LabApp.expose_app_in_browser=True"] + (["--allow-root"] if os.geteuid() == 0 else []),
            cwd=self.root, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes = {}  # pid -> psutil.Process, everything seen under the server

    def url(self, path):
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?token={self.token}"

    def wait_ready(self, limit=120):
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"JupyterLab did not answer within {limit} s; see {self.log.name}")

    def descendants(self):
        """Every live process under the server (kernels, forkservers, ranks), remembered for stop()."""
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        for p in found:
            self.processes.setdefault(p.pid, p)
        return found

    def stop(self):
        """Stop the server and everything it started; SIGKILL whatever is left after 10 s."""
        self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a clean shutdown stops the kernels too
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for p in [psutil.Process(self.proc.pid)] if self.proc.poll() is None else []:
            p.kill()
        for p in self.processes.values():
            try:
                if p.is_running():  # is_running() also checks the pid was not reused
                    p.kill()
            except psutil.Error:
                pass
        self.proc.wait(10)
        psutil.wait_procs(list(self.processes.values()), timeout=5)
        self.log.close()
        shutil.rmtree(self.temp, ignore_errors=True)


class Notebook:
    """One notebook open in its own page (its own JupyterLab workspace), driven as a student would."""

    def __init__(self, context, lab, path, workspace, shots):
        self.lab, self.shots = lab, shots
        self.page = context.new_page()
        self.page.goto(lab.url(f"lab/workspaces/{workspace}/tree/{path}") + "&reset")
        self.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                    " && window.jupyterapp.shell.currentWidget.content", timeout=120_000)
        self.page.wait_for_function(f"() => {self._panel}.sessionContext.session?.kernel?.status === 'idle'",
                                    timeout=120_000)

    _panel = "window.jupyterapp.shell.currentWidget"

    def command(self, name, args=None):
        """Start a JupyterLab command (as a menu item would) without waiting for it to finish."""
        self.page.evaluate("([name, args]) => { window.jupyterapp.commands.execute(name, args); }",
                           [name, args or {}])

    def select(self, index):
        self.page.evaluate(f"(i) => {{ {self._panel}.content.activeCellIndex = i; }}", index)

    def run_cell(self, index):
        """Select cell `index` and run it (Ctrl+Enter)."""
        self.select(index)
        self.page.evaluate(f"() => {self._panel}.content.activeCell.node.scrollIntoView()")
        self.command("notebook:run-cell")

    def prompts(self):
        """The execution prompts of the code cells: '[3]:', '[*]:' (running or queued), '[ ]:'."""
        return self.page.eval_on_selector_all(
            ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt", "ns => ns.map(n => n.textContent)")

    def wait_idle(self, limit=180):
        """Until no cell is running or queued and the kernel is idle."""
        self.page.wait_for_timeout(300)  # the run request reaches the kernel first
        self.page.wait_for_function(
            f"""() => {self._panel}.sessionContext.session?.kernel?.status === 'idle' &&
                 ![...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-InputPrompt')]
                   .some(n => n.textContent.includes('*'))""", timeout=limit * 1000, polling=200)

    def is_running(self, index):
        return "*" in self.prompts_of(index)

    def prompts_of(self, index):
        return self.page.evaluate(f"(i) => {self._panel}.content.widgets[i].node"
                                  ".querySelector('.jp-InputPrompt')?.textContent || ''", index)

    def outputs(self, index=None):
        """Text of cell `index`'s outputs (or a list for all cells), read from the page."""
        texts = self.page.evaluate(f"""() => {self._panel}.content.widgets.map(
            c => [...c.node.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent).join('\\n'))""")
        return texts if index is None else texts[index]

    def stderr_outputs(self):
        """Text of every stderr or error output in the page (the red blocks)."""
        return self.page.eval_on_selector_all(
            ".jp-NotebookPanel:not(.lm-mod-hidden) [data-mime-type='application/vnd.jupyter.stderr'],"
            ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output[data-mime-type*='error']",
            "ns => ns.map(n => n.textContent)")

    def wait_for_text(self, index, text, limit=60):
        self.page.wait_for_function(
            f"([i, t]) => ({self._panel}.content.widgets[i].node.querySelector('.jp-OutputArea')"
            "?.textContent || '').includes(t)", arg=[index, text], timeout=limit * 1000, polling=100)

    def toolbar_button(self, command):
        """The visible toolbar button of the open notebook that runs `command` (■ is notebook:interrupt-kernel)."""
        return self.page.locator(f".jp-NotebookPanel-toolbar [data-command='{command}']:visible").first

    def kernel_id(self):
        return self.page.evaluate(f"() => {self._panel}.sessionContext.session?.kernel?.id")

    def screenshot(self, name, cell=None):
        if cell is not None:
            self.page.evaluate(f"(i) => {self._panel}.content.widgets[i].node.scrollIntoView()", cell)
        os.makedirs(self.shots, exist_ok=True)
        path = os.path.join(self.shots, name)
        self.page.screenshot(path=path)
        return path
