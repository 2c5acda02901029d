"""Insert ready-made cells (a JSON list of nbformat cells) into a notebook after the cell with a given id.

    python -m utils.tools.insert_cells lessons/_pending/real_link_cells.json lessons/03_allreduce_from_scratch.ipynb \
        --after d6fc1f8d

The cells go in unexecuted (no outputs, execution_count None): execute the notebook afterwards. Refuses, with a
message, if the id is not in the notebook or if any inserted cell's id is already there (inserting twice).
"""
import argparse
import json
import sys
from pathlib import Path


def insert(cells_path: Path, notebook_path: Path, after: str) -> int:
    """Insert the cells of `cells_path` into `notebook_path` after cell `after`; the number inserted."""
    cells = json.loads(cells_path.read_text())
    notebook = json.loads(notebook_path.read_text())
    ids = [cell.get("id") for cell in notebook["cells"]]
    if after not in ids:
        raise SystemExit(f"{notebook_path}: no cell with id {after!r}; pick one of its cell ids")
    clash = sorted({cell["id"] for cell in cells} & set(ids))
    if clash:
        raise SystemExit(f"{notebook_path} already has cells {clash}: were these cells inserted before?")
    for cell in cells:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    at = ids.index(after) + 1
    notebook["cells"][at:at] = cells
    notebook_path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    return len(cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cells", type=Path, help="a JSON list of nbformat cells")
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--after", required=True, help="the id of the cell the new ones follow")
    args = parser.parse_args(argv)
    count = insert(args.cells, args.notebook, args.after)
    print(f"inserted {count} cells into {args.notebook} after cell {args.after}: execute it now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
