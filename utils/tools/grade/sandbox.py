"""The sandbox every process that runs a student's code starts in: bubblewrap (Linux), one per submission.

What such a process sees, read-only: the operating system (/usr, /etc), this Python and its packages, and the
course's code as the student distribution has it (utils/ without the grader), plus the grader's few modules that
run in there (rank.py, wire.py, processes.py, notebook.py, this one, verdicts/__init__.py, release.py): a copy
staged once per grading run (Stage). What it does not see: the reference labs, the verdict modules (a verdict
process receives its lab's module as text, into memory: rank.py), reference.py, tests/, other submissions, the
grader's output, the instructor's home. It writes only its submission's private folder (its TMPDIR and HOME).
Namespaces of its own: network (a loopback only: the ranks' rendezvous), processes (it sees only its own, and
when the grader kills the sandbox's first process the kernel kills every process in it), IPC, hostname.

Limits, per process (setrlimit, inherited by everything it starts): address space, CPU seconds, processes (with
threads) and file size; a fork bomb or a 20 GB allocation fails inside its own submission. The process count
is per sandbox: as an ordinary user bubblewrap gives each sandbox a user namespace of its own; as root the
processes run as a user id of their own (confine(), a fresh one per submission), with no capabilities left.

Sandbox() raises SandboxUnavailable, saying why and what to install, where it cannot start; the grader refuses to
grade then, unless the instructor passes --no-sandbox (every report then carries UNSANDBOXED_WARNING).
"""
from __future__ import annotations

import ctypes
import json
import os
import random
import resource
import shutil
import site
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
ENV_VARIABLE = "COURSE_SANDBOX"   # the limits (and the user id, as root) confine() applies
GIB = 1 << 30
# The grader's modules that run inside the sandbox (utils/tools/grade/ is left out of the student distribution).
INSIDE = ("tools/grade/__init__.py", "tools/grade/rank.py", "tools/grade/wire.py", "tools/grade/processes.py",
          "tools/grade/notebook.py", "tools/grade/sandbox.py", "tools/grade/verdicts/__init__.py", "tools/release.py")
UNSANDBOXED_WARNING = ("WARNING: graded without the sandbox (--no-sandbox): student code could read the reference "
                       "labs, other submissions and the grades, and use the network (INSTRUCTORS.md, 'The sandbox')")
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf install "
                "bubblewrap), and on Ubuntu 23.10 or later allow it user namespaces (INSTRUCTORS.md, 'The sandbox'); "
                "or grade without it, at your own risk: --no-sandbox")
START_HINT = ("bubblewrap needs user namespaces (as root, or on Ubuntu 23.10 or later allowed to an ordinary user: "
              "INSTRUCTORS.md, 'The sandbox'), and the Python that grades must lie in folders the sandbox shows "
              "(a virtualenv, or the system's); or grade without it, at your own risk: --no-sandbox")


@dataclass
class Limits:
    """Per process: bytes of address space, seconds of CPU, processes and threads, bytes of one file."""
    memory: int = 6 * GIB
    cpu_seconds: int = 900
    processes: int = 512
    file_size: int = 1 * GIB


def bwrap() -> str | None:
    return shutil.which("bwrap")


def _system_binds() -> list:
    """The operating system, read-only: /usr and /etc; /bin, /lib, ... as links where they are links."""
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def _python_paths() -> list:
    """This Python's installation, its environment and every folder on its import path outside the course."""
    found = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.base_exec_prefix)}
    found |= {Path(p) for p in site.getsitepackages() + [p for p in sys.path if p]}
    found.add(Path(sys.executable).resolve().parent.parent)
    kept = []
    for path in sorted(p.resolve() for p in found if p.exists()):
        if path == REPO_ROOT or REPO_ROOT.is_relative_to(path) or str(path).startswith(("/usr/", "/etc/")):
            continue   # the course's folder itself, or a folder holding it (e.g. a virtualenv's parent): never
        if path.is_relative_to(REPO_ROOT) and not (path / "pyvenv.cfg").exists() and "site-packages" not in path.parts:
            continue   # inside the course only its environment
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


class Stage:
    """The course's code as a sandbox sees it: a copy, made once per grading run, of utils/ without the grader
    (the student distribution's cut, utils/tools/distribution.PRIVATE) but with INSIDE, read-only. Compiled
    modules are copied with their sources (times kept, so Python uses them); a private module's are not."""

    def __init__(self):
        from ..distribution import PRIVATE

        self.folder = Path(tempfile.mkdtemp(prefix="grade-stage-"))
        target = self.folder / "utils"
        shutil.copytree(REPO_ROOT / "utils", target)   # copy2: modification times kept
        for path in sorted(target.rglob("*.py")):
            relative = path.relative_to(target).as_posix()
            if relative not in INSIDE and any(relative == p or relative.startswith(p + "/") for p in PRIVATE):
                path.unlink()
        for compiled in list(target.rglob("__pycache__/*.pyc")):  # only a module that is there keeps its bytecode
            if not (compiled.parent.parent / (compiled.name.split(".")[0] + ".py")).exists():
                compiled.unlink()
        for path in [self.folder, *self.folder.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)

    def close(self):
        shutil.rmtree(self.folder, ignore_errors=True)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start here; the message says why and what to install or enable."""


class Sandbox:
    """One grading run's sandbox: the staged code, the limits; view() gives one submission's command prefix.
    Starting one checks that a sandboxed Python runs (SandboxUnavailable otherwise)."""

    def __init__(self, limits: Limits = None):
        self.limits = limits or Limits()
        if not sys.platform.startswith("linux"):
            raise SandboxUnavailable(f"the grader's sandbox needs Linux (this is {sys.platform})")
        if bwrap() is None:
            raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}")
        self.stage = Stage()
        self.pythons = _python_paths()
        try:
            self._check()
        except BaseException:
            self.close()
            raise

    def _check(self):
        """Run confine() in a sandbox and see it report the user it became."""
        folder = Path(tempfile.mkdtemp(prefix="grade-probe-"))
        try:
            view = self.view(folder)
            from .processes import child_environment
            done = subprocess.run(view.prefix + [sys.executable, "-I", str(Path(__file__).resolve())], cwd=folder,
                                  capture_output=True, text=True, timeout=120,
                                  env=child_environment(folder, **view.env))
        except (OSError, subprocess.SubprocessError) as error:
            raise SandboxUnavailable(f"bubblewrap could not start a sandbox ({error}): {INSTALL_HINT}") from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if done.returncode != 0 or done.stdout.split() != ["confined", str(view.uid or os.getuid())]:
            why = (done.stderr.strip().splitlines() or [done.stdout.strip() or "no message"])[-1][:300]
            raise SandboxUnavailable(f"bubblewrap is installed but could not start a sandbox ({why}): {START_HINT}")

    def close(self):
        self.stage.close()

    def view(self, private: Path) -> "View":
        """A sandbox for one submission whose private folder (writable, everything else read-only) is `private`."""
        uid = random.SystemRandom().randrange(1 << 20, 1 << 30) if os.getuid() == 0 else None
        if uid is not None:   # the submission's own user id owns its private folder
            for path in [private, *private.rglob("*")]:
                os.chown(path, uid, uid, follow_symlinks=False)
        args = [bwrap(), "--die-with-parent", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--hostname", "grader", *_system_binds(), "--proc", "/proc", "--dev", "/dev"]
        binds = [("--ro-bind", path, path) for path in self.pythons]
        prefix = Path(sys.prefix).absolute()   # a virtualenv reached through a symlink: seen where it is named
        if prefix.resolve() != prefix and prefix.resolve() in self.pythons:
            binds.append(("--ro-bind", prefix.resolve(), prefix))
        binds += [("--ro-bind", self.stage.folder / "utils", REPO_ROOT / "utils"), ("--bind", private, private)]
        made = set()
        for _, _, target in binds:  # the folders above each mount point: traversable by the submission's user
            for folder in reversed(Path(target).parents[:-1]):
                if folder not in made:
                    made.add(folder)
                    args += ["--perms", "0755", "--dir", str(folder)]
        for kind, source, target in binds:
            args += [kind, str(source), str(target)]
        args += ["--remount-ro", "/"]
        if uid is not None:   # root: keep only what confine() needs to become the submission's user
            args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        env = {ENV_VARIABLE: json.dumps({"uid": uid, **asdict(self.limits)}), "HOME": str(private),
               "USER": "student", "LOGNAME": "student", "MPLCONFIGDIR": str(private / ".matplotlib")}
        return View(args + ["--"], env, uid)


@dataclass
class View:
    prefix: list    # bwrap and its arguments, then "--"; the command follows
    env: dict       # added to the command's environment
    uid: int | None


def confine() -> None:
    """First thing in every process the sandbox starts (rank.py, notebook.py): apply the limits named in the
    environment, and as root become the submission's own user, keeping no capability. No-op outside a sandbox."""
    spec = os.environ.pop(ENV_VARIABLE, None)
    if not spec:
        return
    spec = json.loads(spec)
    for limit, value in ((resource.RLIMIT_AS, spec["memory"]), (resource.RLIMIT_CPU, spec["cpu_seconds"]),
                         (resource.RLIMIT_NPROC, spec["processes"]), (resource.RLIMIT_FSIZE, spec["file_size"]),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    if spec.get("uid") is not None:
        os.setgroups([])
        os.setresgid(spec["uid"], spec["uid"], spec["uid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])   # drops every capability
    ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)   # PR_SET_NO_NEW_PRIVS: no set-user-ID program
    # regains privileges


if __name__ == "__main__":   # Sandbox._check runs this inside a new sandbox
    confine()
    print("confined", os.getuid())
