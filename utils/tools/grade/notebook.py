"""The feedback run: one prepared notebook, every cell, on a fresh kernel, each cell time- and output-limited.

    python -m utils.tools.grade.notebook NOTEBOOK --result R.json --executed E.ipynb
                                         --cell-timeout S --max-output BYTES --sockets DIR

Started by the grader in its own session and in the submission's sandbox (utils/tools/grade/sandbox.py), with
the submission's folder as working directory and TMPDIR private. The kernel's channels are IPC sockets in DIR (utils/tools/kernels.py). Points never come from here:
this run gives the student their notebook's own check messages, and the instructor the executed copy.

Once a graded test cell fails, a later ungraded cell that calls a function the failed cell checked is not run (its
output says so): a plot of an endless `ring_time` would otherwise cost another cell timeout.

R.json: {"cells": {"<index>": {"status": ok|error|timeout|output-limit|crashed|skipped, "message"}}, "kernel_pid",
"kernel_died_in_cell", "finished"}, rewritten after every cell so a killed run still reports the cells it
finished.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import nbformat

from ..kernels import ipc_kernel_manager_class
from ..release import names_used, nbgrader_meta, read_notebook, solution_functions, write_notebook
from .processes import become_subreaper, die_with_parent, exit_on_signals, kill_descendants
from .sandbox import confine

TIMEOUT_ENAME = "CellTimeout"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def run_one(notebook, result_path, executed_path, cell_timeout, max_output, sockets) -> int:
    """Run every code cell of one prepared notebook; after each cell, record how it went."""
    import asyncio

    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.utils import ensure_async
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    die_with_parent()
    become_subreaper()
    exit_on_signals()
    notebook = Path(notebook)
    nb = read_notebook(notebook)
    results = {"cells": {}, "kernel_pid": None, "kernel_died_in_cell": None, "finished": False}

    def save():
        partial = Path(result_path).with_suffix(".tmp")
        partial.write_text(json.dumps(results))
        os.replace(partial, result_path)
        write_notebook(nb, executed_path)

    class ThisPython(KernelSpecManager):
        """Always this interpreter's ipykernel, whatever kernelspecs the machine has."""
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict())

    # the kernel keeps the submission's private TMPDIR (removed by the grader), where a test looks for it
    with ipc_kernel_manager_class(AsyncKernelManager, parent=sockets, temp_folder=False) as manager_class:

        class Client(NotebookClient):
            """nbclient with a cap on what one cell may print."""
            printed, over, last_reply = 0, False, None

            def create_kernel_manager(self):
                self.km = manager_class(kernel_name="python3", kernel_spec_manager=ThisPython())
                return self.km

            def output(self, outs, msg, display_id, cell_index):
                if msg["msg_type"] != "error":
                    content = msg["content"]
                    data = content.get("data") or {}
                    self.printed += len(content.get("text", "")) + sum(len(str(v)) for v in data.values())
                if self.printed > max_output:
                    if not self.over:
                        self.over = True
                        outs.append(nbformat.v4.new_output(
                            "stream", name="stderr", text=f"\n[grader: output stopped; this cell printed more "
                                                          f"than {max_output} bytes]\n"))
                        self.stopper = asyncio.ensure_future(ensure_async(self.km.interrupt_kernel()))
                    return None
                return super().output(outs, msg, display_id, cell_index)

        def remember(cell, cell_index, execute_reply):
            client.last_reply = execute_reply

        client = Client(nb, timeout=int(cell_timeout), allow_errors=True, interrupt_on_timeout=True,
                        error_on_timeout={"ename": TIMEOUT_ENAME,
                                          "evalue": f"the cell ran longer than {cell_timeout:g} s", "traceback": []},
                        iopub_timeout=4, record_timing=False, on_cell_executed=remember,
                        resources={"metadata": {"path": str(notebook.parent)}})
        try:
            with client.setup_kernel():
                results["kernel_pid"] = getattr(client.km.provisioner, "pid", None)
                save()
                theirs, failed = solution_functions(nb), set()
                for index, cell in enumerate(nb.cells):
                    if cell.cell_type != "code":
                        continue
                    meta = nbgrader_meta(cell)
                    calls_failed = [n for n in names_used(cell.source) if n in failed]
                    if calls_failed and not meta.get("grade") and not meta.get("solution"):
                        message = (f"not run: it calls {', '.join(calls_failed)}, whose check failed "
                                   "above")
                        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"[grader: {message}]\n")]
                        results["cells"][str(index)] = {"status": "skipped", "message": message}
                        save()
                        continue
                    client.printed, client.over, client.last_reply = 0, False, None
                    try:
                        client.execute_cell(cell, index, execution_count=index + 1)
                    except DeadKernelError:
                        results["kernel_died_in_cell"] = index
                        results["cells"][str(index)] = {
                            "status": "crashed",
                            "message": "the kernel died while running this cell (os._exit, a segfault, or out of memory)"}
                        save()
                        break
                    results["cells"][str(index)] = cell_result(cell, client.last_reply, client.over, max_output)
                    if meta.get("grade") and results["cells"][str(index)]["status"] != "ok":
                        failed |= {n for n in names_used(cell.source) if n in theirs}
                    save()
            results["finished"] = results["kernel_died_in_cell"] is None
        finally:
            save()
            kill_descendants()
    return 0


def cell_result(cell, reply, over, max_output) -> dict:
    content = (reply or {}).get("content", {})
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    tail = "\n".join(_ANSI.sub("", text).strip().splitlines()[-15:])[-2000:]
    if over:
        return {"status": "output-limit", "message": f"the cell printed more than {max_output} bytes and was stopped"}
    if content.get("status") == "error":
        ename, evalue = content.get("ename", "Error"), _ANSI.sub("", str(content.get("evalue", "")))
        status = "timeout" if ename == TIMEOUT_ENAME else "error"
        message = f"{ename}: {evalue}"[:1500]
        if tail and status == "error":
            message = f"{message}\noutput before the error:\n{tail}"
        return {"status": status, "message": message}
    return {"status": "ok", "message": ""}


def main(argv=None) -> int:
    confine()  # in a sandbox: its limits, and as root the submission's own user (before the kernel starts)
    parser = argparse.ArgumentParser(prog="python -m utils.tools.grade.notebook", description=__doc__.split("\n")[0])
    parser.add_argument("notebook")
    parser.add_argument("--result", required=True)
    parser.add_argument("--executed", required=True)
    parser.add_argument("--cell-timeout", type=float, required=True)
    parser.add_argument("--max-output", type=int, required=True)
    parser.add_argument("--sockets", required=True)
    args = parser.parse_args(argv)
    return run_one(args.notebook, args.result, args.executed, args.cell_timeout, args.max_output, args.sockets)


if __name__ == "__main__":
    sys.exit(main())
