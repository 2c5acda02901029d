"""utils.compat, the one bridge for torch API differences across the supported releases (2.6 to 2.14).

What runs here runs on this environment's torch; CI's `make compat-ends` runs every notebook on both ends of the
range. These tests check each bridge's choice on either side of its version line, and that no lesson, lab,
script, benchmark or utils module goes around the bridge.
"""
import json
import re
import socket
import warnings
from datetime import timedelta
from pathlib import Path

import nbformat
import pytest
import torch.distributed as dist
from nbclient import NotebookClient

from utils import compat
from utils.tools.kernels import ipc_kernel_manager_class

ROOT = Path(__file__).resolve().parents[1]


def test_tcp_store_serves_on_a_socket_it_takes_over():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    store = compat.tcp_store("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=30), master_listen_fd=listener.fileno())
    listener.detach()
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize("takes_fd, expected", [(True, {}), (False, {"use_libuv": False})])
def test_tcp_store_asks_for_the_legacy_backend_only_where_libuv_cannot_take_a_socket(monkeypatch, takes_fd, expected):
    calls = []
    monkeypatch.setattr(compat, "_LIBUV_TAKES_LISTEN_FD", takes_fd)
    monkeypatch.setattr(compat.dist, "TCPStore", lambda *args, **kwargs: calls.append(kwargs))
    compat.tcp_store("127.0.0.1", 1, 2, is_master=True, master_listen_fd=5)
    compat.tcp_store("127.0.0.1", 1, 2, is_master=False)
    assert calls == [{"is_master": True, "master_listen_fd": 5, **expected}, {"is_master": False}]


@pytest.mark.parametrize("can_hang, backend, expected", [(False, "gloo", ["destroy"]), (True, "gloo", ["barrier"]),
                                                         (True, "nccl", ["destroy"])])
def test_a_group_is_ended_without_the_gloo_destructor_where_it_can_hang(monkeypatch, can_hang, backend, expected):
    calls = []
    monkeypatch.setattr(compat, "_GLOO_DESTROY_CAN_HANG", can_hang)
    monkeypatch.setattr(compat.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(compat.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(compat.dist, "destroy_process_group", lambda: calls.append("destroy"))
    compat.end_group_before_exit()
    assert calls == expected


def test_a_broken_group_ends_without_an_error(monkeypatch):
    def broken():
        raise RuntimeError("Connection closed by peer")
    monkeypatch.setattr(compat, "_GLOO_DESTROY_CAN_HANG", True)
    monkeypatch.setattr(compat.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(compat.dist, "barrier", broken)
    compat.end_group_before_exit()


def test_requires_runs_a_cell_skips_it_in_one_line_or_fails_it():
    cells = [f"import sys; sys.path.insert(0, {str(ROOT)!r})\nimport utils\nfrom utils import compat",
             "compat.FEATURES['present'] = (True, '')\ncompat.FEATURES['absent'] = (False, 'no such thing here')",
             "%%requires present\nx = 41\nprint('ran')\nx + 1",
             "%%requires absent\nprint('ran anyway')\nraise ValueError('never')",
             "%%requires present\nraise ValueError('a failing check fails its cell')",
             "%%requires nonsense\n1"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    # the tools' kernel manager: its kernel's TMPDIR is a private folder removed afterwards (a kernel is stopped by
    # killing its process group, forkserver included, which left multiprocessing's pymp-* folder in /tmp)
    with ipc_kernel_manager_class() as manager_class:
        NotebookClient(nb, allow_errors=True, timeout=120, kernel_manager_class=manager_class).execute()
    outputs = [[o.get("text") or o.get("data", {}).get("text/plain") or o.get("ename") for o in c.outputs]
               for c in nb.cells]
    assert outputs[2] == ["ran\n", "42"]
    assert outputs[3] == [f"(skipped on torch {compat.torch.__version__}: no such thing here)\n"]
    assert "ValueError" in outputs[4] and outputs[5] == ["ValueError"]
    assert "not a feature utils.compat knows" in "".join(nb.cells[5].outputs[0]["evalue"])


def course_sources():
    """{path: Python source} of every utils module, script, benchmark, and each notebook's code cells."""
    found = {p: p.read_text() for folder in ("utils", "lessons/scripts", "benchmarks")
             for p in (ROOT / folder).rglob("*.py")}
    for p in sorted((ROOT / "lessons").glob("*.ipynb")) + sorted((ROOT / "labs").glob("*.ipynb")):
        found[p] = "\n".join("".join(c["source"]) for c in json.loads(p.read_text())["cells"]
                             if c["cell_type"] == "code")
    return found


# Where a supported torch differs, by name: only utils/compat.py may say these.
AROUND_THE_BRIDGE = re.compile(r"DistributedDataParallel\([^)]*forward_sync_buffers|broadcast_buffers\s*="
                               r"|dist\.all_gather_single\b"
                               r"|dist\.reduce_scatter_single\b|master_listen_fd\s*=|use_libuv"
                               r"|dist\.destroy_process_group\(\)\s*\n\s*sys\.stdout"
                               r"|allow_tf32\s*=|fp32_precision\s*=")


def test_full_float32_turns_tf32_off_through_one_api_without_a_warning():
    backends = compat.torch.backends
    if compat._HAS_FP32_PRECISION:
        settings = [backends.cuda.matmul, backends.cudnn.conv] + ([backends.cudnn.rnn] if hasattr(backends.cudnn, "rnn")
                                                                   else [])
        read = lambda: [s.fp32_precision for s in settings]
        def restore(values):
            for s, value in zip(settings, values):
                s.fp32_precision = value
    else:
        read = lambda: [backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32]
        def restore(values):
            backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = values
    before = read()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compat.full_float32()
            after = read()
    finally:
        restore(before)
    assert after == (["ieee"] * len(after) if compat._HAS_FP32_PRECISION else [False, False])


def test_nothing_goes_around_the_bridge():
    found = {str(path.relative_to(ROOT)): sorted(set(AROUND_THE_BRIDGE.findall(source)))
             for path, source in course_sources().items() if path != ROOT / "utils" / "compat.py"}
    allowed = {"utils/launching.py": ["master_listen_fd="]}   # the call that goes through compat.tcp_store
    assert {k: v for k, v in found.items() if v and allowed.get(k) != v} == {}


def test_fully_shard_is_shown_only_where_this_torch_can_run_it():
    """Lesson 06's FSDP2 cells start with %%requires fsdp2_on_cpu (torch 2.6's FSDP2 cannot run on a CPU)."""
    for path, source in course_sources().items():
        if path.suffix != ".ipynb":
            continue
        for cell in json.loads(path.read_text())["cells"]:
            text = "".join(cell["source"])
            if cell["cell_type"] == "code" and ("fully_shard" in text or "torch_diff" in text):
                assert text.startswith("%%requires fsdp2_on_cpu\n"), f"{path.name}: {text[:80]}"
