"""make test-portable (utils/tools/portable.py): the notebooks' strict nbval on another CPU code path catches an
output that depends on the CPU, and passes one printed to the digits rounding cannot change."""
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from utils.tools import portable
from utils.tools.kernels import ipc_kernel_manager_class

pytestmark = pytest.mark.skipif(not portable.cpu_has("avx2") or portable.platform.machine() != "x86_64",
                                reason="needs an x86-64 CPU with AVX2 (its native path differs from the scalar one)")

ROOT = Path(__file__).resolve().parents[1]

# ATen's tanh rounds differently on its scalar and vector paths (measured on one CPU: -93.29032135009766 on the
# scalar path, -93.29011535644531 on AVX2 and AVX-512); to one decimal both are -93.3.
VALUE = "torch.manual_seed(0)\nvalue = torch.randn(128, 128).tanh().sum().item()\n"


def executed_notebook(path, source):
    """Write a one-cell notebook and execute it here, on this CPU's native path (its stored output)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import torch\n" + VALUE + source)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    with ipc_kernel_manager_class() as manager_class:
        NotebookClient(nb, kernel_manager_class=manager_class, resources={"metadata": {"path": str(path.parent)}},
                       timeout=120).execute()
    nbformat.write(nb, str(path))
    return path


def test_the_paths_it_asks_for_are_the_paths_torch_takes():
    line = portable.check_path("scalar")
    assert "ATen DEFAULT" in line and ("SSE4.2" in line or "CNR COMPATIBLE" in line) and "SSE4.1" in line, line
    assert "unconfirmed" not in line, line
    assert portable.main(["sse9"]) == 2


@pytest.mark.parametrize("name, got, verdict", [
    # an Intel CPU: MKL's banner names what it enabled
    ("avx2", ("AVX2", "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2)", "OFF", "Intel AVX2"), "confirmed"),
    ("avx2", ("AVX2", "Intel(R) Streaming SIMD Extensions 4.2 (Intel(R) SSE4.2)", "OFF", "Intel AVX2"), "raises"),
    # a CPU MKL names no instruction set for (AMD's): the scalar path rests on MKL_CBWR, the others say unconfirmed
    ("scalar", ("DEFAULT", portable.GENERIC_MKL, "COMPATIBLE", "Intel SSE4.1"), "confirmed"),
    ("scalar", ("DEFAULT", portable.GENERIC_MKL, "AUTO", "Intel SSE4.1"), "raises"),
    ("avx2", ("AVX2", portable.GENERIC_MKL, "OFF", "Intel AVX2"), "unconfirmed"),
    ("avx2", ("DEFAULT", portable.GENERIC_MKL, "OFF", "Intel AVX2"), "raises"),       # ATen ignored it
    ("avx512", ("AVX512", portable.GENERIC_MKL, "OFF", "Intel AVX2"), "raises"),     # oneDNN ignored it
])
def test_a_path_is_confirmed_only_by_what_each_library_reports(name, got, verdict):
    if verdict == "raises":
        with pytest.raises(RuntimeError, match="ignores a setting"):
            portable.check_path(name, got=got)
    else:
        line = portable.check_path(name, got=got)
        assert ("unconfirmed" in line) == (verdict == "unconfirmed"), line


def test_a_cpu_dependent_output_fails_on_the_scalar_path_and_rounded_digits_pass(tmp_path):
    values = [subprocess.run([sys.executable, "-c", "import torch\n" + VALUE + "print(repr(value))"],
                             env=environment, capture_output=True, text=True, timeout=120).stdout
              for environment in (None, portable.environment("scalar"))]
    if values[0] == values[1]:
        pytest.skip(f"this CPU's native path gives the scalar path's value ({values[0].strip()})")
    raw = executed_notebook(tmp_path / "raw.ipynb", "print(repr(value))")
    rounded = executed_notebook(tmp_path / "rounded.ipynb", "print(f'{value:.1f}')   # 1e-4 relative apart")
    status = portable.run_path("scalar", ["-p", "no:xdist"], notebooks=[raw, rounded], capture_output=True,
                               text=True, timeout=300, cwd=ROOT)
    assert status == 1, "the raw float differs on the scalar path, so nbval must fail"
    assert portable.run_path("scalar", ["-p", "no:xdist"], notebooks=[rounded], capture_output=True, timeout=300,
                             cwd=ROOT) == 0
