"""Run the notebooks' strict nbval on another CPU code path: a compared output that depends on the CPU fails here.

    python -m utils.tools.portable scalar avx2 [-- PYTEST ARGS]      (make test-portable)

The stored outputs were recorded on one CPU; students and CI runners have others. A CPU changes floats through the
instruction set its kernels use (a sum in 16-wide AVX-512 lanes rounds differently from one in 8-wide AVX2 lanes or
one at a time), so this runs every notebook again with torch told to take another path, and nbval compares each
output with the stored one. Three libraries choose their instruction sets separately, so each path sets all three:

    ATen (torch's own kernels)    ATEN_CPU_CAPABILITY      default (scalar) | avx2 | avx512
    MKL (matrix multiplies)       MKL_ENABLE_INSTRUCTIONS  SSE4_2           | AVX2 | AVX512
                                  MKL_CBWR                 COMPATIBLE       |  -   |  -
    oneDNN (convolutions, ...)    ONEDNN_MAX_CPU_ISA       SSE41            | AVX2 | AVX512_CORE

A value a library does not know is ignored with a warning, so before running anything this checks, in a fresh
interpreter, that each library reports the path it was asked for, and prints what they report; a path the CPU does
not have (avx2 on an older CPU) is skipped with one line. MKL names its instruction set in its verbose banner only on
Intel CPUs; on others (AMD's, for one) the banner says "Intel(R) Architecture processors" whatever was asked. The
scalar path therefore also sets MKL_CBWR=COMPATIBLE (MKL's reproducible SSE2 branch, honoured on every vendor and
reported on each call as CNR:COMPATIBLE), so it is confirmed everywhere; on such a CPU the avx2 and avx512 paths
confirm ATen and oneDNN and print MKL's part as unconfirmed. ARM's NEON path cannot be chosen
on an x86 CPU: the argument for it is in the README (the rules that keep outputs portable are the same).
Exit status: 0 when every requested path passed or was skipped, 1 when one failed, 2 for an unknown path name.
"""
import os
import platform
import subprocess
import sys
import time

PATHS = {
    # name: (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA, MKL_CBWR or None,
    #        what ATen, MKL's verbose banner and oneDNN's verbose ISA line then report)
    "scalar": ("default", "SSE4_2", "SSE41", "COMPATIBLE", ("DEFAULT", "(Intel(R) SSE4.2)", "Intel SSE4.1")),
    "avx2": ("avx2", "AVX2", "AVX2", None, ("AVX2", "(Intel(R) AVX2)", "Intel AVX2")),
    "avx512": ("avx512", "AVX512", "AVX512_CORE", None, ("AVX512", "(Intel(R) AVX-512)", "Intel AVX-512")),
}

GENERIC_MKL = "Intel(R) Architecture processors"   # MKL's banner on a CPU it names no instruction set for

NOTEBOOKS = ["lessons", "labs"]

# Run in the path's environment with MKL_VERBOSE and ONEDNN_VERBOSE set: what ATen uses, then a matrix multiply
# (MKL prints a banner naming the instructions it enabled) and a convolution (oneDNN prints the ISA it may use).
PROBE = r"""
import torch
print("aten", torch.backends.cpu.get_cpu_capability(), flush=True)
a = torch.ones(64, 64)
a @ a
torch.nn.Conv2d(16, 16, 3)(torch.ones(4, 16, 32, 32))
"""


def environment(name: str) -> dict:
    """The process environment for code path `name` (the three libraries' variables set)."""
    aten, mkl, onednn, cbwr, _ = PATHS[name]
    env = dict(os.environ)
    env.update(ATEN_CPU_CAPABILITY=aten, MKL_ENABLE_INSTRUCTIONS=mkl, ONEDNN_MAX_CPU_ISA=onednn)
    env.pop("MKL_CBWR", None)
    if cbwr:
        env["MKL_CBWR"] = cbwr
    return env


def cpu_has(name: str) -> bool:
    """Whether this CPU can run path `name` (scalar always; the others by /proc/cpuinfo's flags)."""
    need = {"scalar": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl"}}[name]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return not need
    return need <= set(flags)


def probe(name: str) -> tuple:
    """(ATen's capability, MKL's banner, MKL's CNR mode, oneDNN's ISA line) as a fresh interpreter on path `name`
    reports them."""
    env = environment(name)
    env.update(MKL_VERBOSE="1", ONEDNN_VERBOSE="1")
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed on path {name}:\n{done.stderr[-2000:]}")
    lines = done.stdout.splitlines()
    aten = next((line.split()[1] for line in lines if line.startswith("aten ")), "?")
    mkl = next((line.split(" for Intel(R) 64 architecture ", 1)[-1].split(" enabled processors")[0].split(",")[0]
                for line in lines if line.startswith("MKL_VERBOSE") and "architecture" in line), "?")
    cnr = next((line.split(" CNR:", 1)[1].split()[0] for line in lines
                if line.startswith("MKL_VERBOSE") and " CNR:" in line), "?")
    isa = next((line.split("isa:", 1)[1].split(",")[0].strip() for line in lines if ",isa:" in line), "?")
    return aten, mkl, cnr, isa


def check_path(name: str, got=None) -> str:
    """Raise unless ATen, MKL and oneDNN all report path `name` (MKL by its banner, or by its CNR mode where the path
    sets one); return the line that says what they report. `got`: probe(name)'s answer, when already known."""
    aten, mkl, onednn = PATHS[name][4]
    cbwr = PATHS[name][3]
    got_aten, got_mkl, got_cnr, got_onednn = probe(name) if got is None else got
    mkl_line = f"MKL {got_mkl}" + (f" (CNR {got_cnr})" if got_cnr != "?" else "")
    mkl_took = mkl in got_mkl or (cbwr is not None and got_cnr == cbwr)
    mkl_silent = GENERIC_MKL in got_mkl and cbwr is None   # this MKL names no instruction set on this CPU
    if got_aten != aten or onednn not in got_onednn or not (mkl_took or mkl_silent):
        raise RuntimeError(f"asked for the {name} path but ATen reports {got_aten}, {mkl_line}, oneDNN "
                           f"'{got_onednn}' (wanted {aten} / {mkl}" + (f" or CNR {cbwr}" if cbwr else "")
                           + f" / {onednn}): this torch or CPU ignores a setting")
    if not mkl_took:
        mkl_line += " (unconfirmed: MKL names no instruction set on this CPU)"
    return f"ATen {got_aten}, {mkl_line}, oneDNN {got_onednn}"


def run_path(name: str, pytest_args: list, notebooks=NOTEBOOKS, **run_options) -> int:
    """Strict nbval of every notebook (of `notebooks`: folders or files) on path `name`; pytest's exit status."""
    command = [sys.executable, "-m", "pytest", *map(str, notebooks), "--nbval", "--nbval-current-env",
               "--nbval-sanitize-with", "tests/sanitize.cfg", "--nbval-cell-timeout=300", "-q", *pytest_args]
    return subprocess.run(command, env=environment(name), **run_options).returncode


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    names = argv[:argv.index("--")] if "--" in argv else argv
    unknown = [n for n in names if n not in PATHS]
    if not names or unknown:
        print(f"usage: python -m utils.tools.portable PATH [PATH ...] [-- PYTEST ARGS]; PATH is one of "
              f"{', '.join(PATHS)}" + (f" (not {', '.join(unknown)})" if unknown else ""), file=sys.stderr)
        return 2
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"portable: skipped, the paths are x86-64 instruction sets and this CPU is {platform.machine()}")
        return 0
    failed = []
    for name in names:
        if not cpu_has(name):
            print(f"portable: path {name}: skipped, this CPU lacks its instructions", flush=True)
            continue
        start = time.monotonic()
        try:
            print(f"portable: path {name}: {check_path(name)}", flush=True)
        except RuntimeError as exc:
            print(f"portable: path {name}: FAILED: {exc}", flush=True)
            failed.append(name)
            continue
        status = run_path(name, pytest_args)
        print(f"portable: path {name}: {'passed' if status == 0 else 'FAILED'} "
              f"in {time.monotonic() - start:.0f} s", flush=True)
        if status != 0:
            failed.append(name)
    if failed:
        print(f"portable: outputs differ on {', '.join(failed)}: a compared output depends on the CPU "
              "(COURSE.md, Determinism rules)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
