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


def problems(nb) -> list:
    """Everything wrong with a stored notebook, as readable sentences (empty when clean)."""
    found = []
    if nb["metadata"].get("kernelspec", {}).get("name") != "python3":
        found.append("kernelspec is not python3 (one kernelspec for all notebooks)")
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in cells if c["source"]]
    if not all(isinstance(n, int) for n in counts):
        found.append("not every code cell is executed: commit the executed notebook")
    elif counts != sorted(counts):
        found.append("cells executed out of order: re-run the whole notebook")
    for cell in cells:
        where = f"cell starting {''.join(cell['source'])[:50]!r}"
        for output in cell["outputs"]:
            if output["output_type"] == "error":
                found.append(f"stored error in {where}")
            if output["output_type"] == "stream" and output["name"] == "stderr":
                found.append(f"stderr in {where}: fix the warning's cause")
            text = output_text(output)
            if MACHINE_PATH.search(text):
                found.append(f"machine path in {where}: {MACHINE_PATH.search(text)[0]}")
            if ADDRESS.search(text):
                found.append(f"memory address in {where}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_is_executed_and_clean(path):
    assert problems(json.loads(path.read_text())) == []


def test_hygiene_check_catches_each_problem():
    def cell(count, *outputs):
        return {"cell_type": "code", "source": "x = 1", "execution_count": count, "metadata": {},
                "outputs": list(outputs)}
    bad = {"metadata": {"kernelspec": {"name": "conda-env-py"}}, "cells": [
        cell(2, {"output_type": "stream", "name": "stderr", "text": "UserWarning: careful"}),
        cell(1, {"output_type": "error", "ename": "ValueError", "evalue": "", "traceback": []}),
        cell(3, {"output_type": "stream", "name": "stdout", "text": "saved to /home/ada/run.pt"}),
        cell(4, {"output_type": "execute_result", "execution_count": 4, "metadata": {},
                 "data": {"text/plain": "<Thing at 0x7f3a2b1c9d00>"}}),
    ]}
    found = " | ".join(problems(bad))
    for words in ("kernelspec", "out of order", "stderr", "stored error", "machine path", "memory address"):
        assert words in found
    bad["cells"][0]["execution_count"] = None
    assert "not every code cell is executed" in " | ".join(problems(bad))


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.parent.name in ("lessons", "labs")],
                         ids=lambda p: p.name)
def test_notebook_has_setup_and_parameters_cells(path):
    cells = code_cells(path)
    assert "import utils" in "".join(cells[0]["source"]), "first code cell is the setup cell"
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters' (for papermill)"


LESSON_SHAPE = ("colab-badge", "Learning goals", "Prerequisites", "Check yourself", "<details>", "Key takeaways")


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.parent.name == "lessons"], ids=lambda p: p.name)
def test_lesson_follows_the_course_shape(path):
    nb = json.loads(path.read_text())
    markdown = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    missing = [part for part in LESSON_SHAPE if part not in markdown]
    assert not missing, f"{path.name} lacks {missing} (see ../shared/COURSE.md, 'One lesson, one shape')"
