"""Hygiene of every committed notebook: executed, no errors or stderr, nothing machine-specific.

nbval (run by `make test` over lessons/ and labs/) checks that outputs *reproduce*; these tests
check what the stored outputs may contain at all.
"""
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for folder in ("lessons", "labs") for p in (ROOT / folder).rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)
MACHINE_PATH = re.compile(r"(/work/|/home/|/root/|/tmp/|/Users/|site-packages|C:\\\\)")
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def output_text(output):
    if output["output_type"] == "stream":
        return "".join(output["text"])
    if output["output_type"] == "error":
        return output["ename"] + ": " + output["evalue"]
    data = output.get("data", {})
    return "".join("".join(v) if isinstance(v, list) else str(v)
                   for k, v in data.items() if k.startswith("text/"))


def test_there_are_notebooks():
    assert any(p.name == "00_launching.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_is_executed_and_clean(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3", "one kernelspec for all notebooks: python3"
    cells = code_cells(path)
    counts = [c["execution_count"] for c in cells if c["source"]]
    assert all(isinstance(n, int) for n in counts), "every code cell must be executed (commit outputs)"
    assert counts == sorted(counts), "cells executed out of order: re-run the whole notebook"
    for cell in cells:
        source = "".join(cell["source"])
        for output in cell["outputs"]:
            where = f"cell starting {source[:50]!r}"
            assert output["output_type"] != "error", f"stored error in {where}"
            assert not (output["output_type"] == "stream" and output["name"] == "stderr"), \
                f"stderr in {where}: fix the warning's cause"
            text = output_text(output)
            assert not MACHINE_PATH.search(text), f"machine path in {where}: {MACHINE_PATH.search(text)[0]}"
            assert not ADDRESS.search(text), f"memory address in {where}"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.parent.name in ("lessons", "labs")],
                         ids=lambda p: p.name)
def test_notebook_has_setup_and_parameters_cells(path):
    cells = code_cells(path)
    assert "import utils" in "".join(cells[0]["source"]), "first code cell is the setup cell"
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters' (for papermill)"
