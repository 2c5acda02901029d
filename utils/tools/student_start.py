"""The students' set-up and their two commands (the distribution writes this file as course.py at its root).

    python3 course.py [JUPYTERLAB OPTIONS]               set up on first use, then open the lessons in JupyterLab
                                                         (options pass through, e.g. --allow-root --no-browser)
    python3 course.py check labs/lab1_collectives.ipynb  run a lab headless: every check cell runs, also after one
                                                         fails; a line per part (✓ or ✗ and what to fix) on the
                                                         console, the executed copy in build/labs/

Set-up, once, in .venv beside this file: the pinned torch (the CPU build from PyTorch's CPU wheel index on a
Linux machine without an NVIDIA GPU, PyPI's CUDA build where `nvidia-smi` lists a GPU; macOS and Windows get
PyPI's build), then the course with `pip install -e ".[dev]"`. TORCH_SPEC="torch==X ..." chooses another torch;
PIP_OPTIONS (e.g. "--proxy http://host:3128") is added to every pip command. Where PyTorch's wheel index cannot be
reached (a proxy that blocks it, a mirror of PyPI only, an offline machine), TORCH_SPEC="torch==2.13.0" takes PyPI's
build instead, and TORCH_SPEC="/path/to/torch-....whl" a wheel file you have. Uses only the standard library, so
the system's python3 (3.11 is the tested one) runs it before anything is installed.
"""
import os
import platform
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

TORCH_VERSION = "2.13.0"   # the course's pinned torch (a test keeps it in step with the course's own set-up)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
STAMP = VENV / ".course-installed"


def has_nvidia_gpu() -> bool:
    """Whether `nvidia-smi -L` lists a GPU here."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def torch_spec() -> list:
    """pip's arguments for torch: TORCH_SPEC if set, else the pinned version from the index that fits."""
    if os.environ.get("TORCH_SPEC"):
        return shlex.split(os.environ["TORCH_SPEC"])
    spec = [f"torch=={TORCH_VERSION}"]
    if platform.system() == "Linux" and not has_nvidia_gpu():
        spec += ["--index-url", CPU_INDEX]   # PyPI's Linux wheels are CUDA builds: gigabytes a CPU cannot use
    return spec


# What to do when torch cannot be installed from where torch_spec() points (printed after pip's own message).
_WAYS = [  # (command, what it does): where torch can come from when PyTorch's own index is out of reach
    ('PIP_OPTIONS="--proxy http://HOST:PORT" python3 course.py', "every pip command goes through your proxy"),
    (f'TORCH_SPEC="torch=={TORCH_VERSION}" python3 course.py',
     "PyPI's build: on Linux a CUDA build, several GB to download (about 6 GB installed); it runs on a CPU too"),
    (f'TORCH_SPEC="/path/to/torch-{TORCH_VERSION}-...whl" python3 course.py', "a wheel file you downloaded elsewhere"),
    ('PIP_OPTIONS="--index-url https://MIRROR/simple" python3 course.py', "your institution's mirror"),
]
TORCH_HELP = ("torch could not be installed with: {spec}\n"
              "If pip could not reach that index (a proxy, a mirror of PyPI only, an offline machine), choose where "
              "torch comes from:\n"
              + "".join(f"  {command}\n      {what}\n" for command, what in _WAYS)
              + "(supported: any torch from 2.6 to 2.14). Otherwise fix what pip said above and run this again.")


def pip(*args) -> None:
    command = [str(PYTHON), "-m", "pip", "install", "--quiet", *shlex.split(os.environ.get("PIP_OPTIONS", "")), *args]
    print("$ " + " ".join(shlex.quote(a) for a in command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def set_up() -> None:
    """Create .venv and install torch and the course, unless done before."""
    if STAMP.exists():
        return
    if sys.version_info < (3, 10):
        sys.exit(f"Python {sys.version.split()[0]} is too old: run this with Python 3.11 (the tested one)")
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    try:
        pip(*torch_spec())
    except subprocess.CalledProcessError:
        print(TORCH_HELP.format(spec=" ".join(torch_spec())), file=sys.stderr)
        raise
    pip("-e", ".[dev]")
    STAMP.touch()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    checking = argv[:1] == ["check"]
    if checking and len(argv) < 2 or not checking and any(not a.startswith("-") for a in argv):
        print("usage:\n" + __doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        set_up()
    except subprocess.CalledProcessError as failed:
        print(f"set-up stopped: pip failed (exit {failed.returncode}); fix what it said above and run this again",
              file=sys.stderr)
        return 1
    if checking:
        notebooks = [str(Path(a).resolve()) for a in argv[1:]]
        return subprocess.run([str(PYTHON), "-m", "utils.tools.run", *notebooks, "--keep-going", "--out", "build"],
                              cwd=ROOT).returncode
    # this environment's kernelspecs first: the notebooks' python3 kernel is then .venv's Python
    env = dict(os.environ, JUPYTER_PATH=os.pathsep.join(
        [str(VENV / "share" / "jupyter")] + [p for p in [os.environ.get("JUPYTER_PATH")] if p]))
    return subprocess.run([str(PYTHON), "-m", "jupyter", "lab", "lessons/00_launching.ipynb", *argv], cwd=ROOT,
                          env=env).returncode

if __name__ == "__main__":
    sys.exit(main())
