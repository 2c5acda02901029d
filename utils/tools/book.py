"""Build the course as a static website from the stored, executed notebooks (nothing is re-executed).

    python -m utils.tools.book --out build/book [--student-repo https://github.com/OWNER/NAME] [--branch main]
    (make book [STUDENT_REPO=...] [BRANCH=...])

The site is Sphinx with MyST-NB (docs/book/conf.py says why that tool). Its pages are built from what
`make distribution` writes, so a lab page, its "download .ipynb" file and every copied file are the student
copies: no reference solution or hidden test can reach the site. The course README is the front page and
INSTRUCTORS.md a page of its own. It works offline: MathJax is bundled from npm (fetched once into a cache)
and no widget script is loaded: a widget's output becomes a note that it needs a live kernel, with its stored
state (each control at its value, each HTML output) shown.

Steps: write the distribution into OUT/../book-src, add the front page, the guides, the images and MathJax,
mark each widget output, then `sphinx-build` into OUT (the HTML: OUT/index.html).
"""
from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import distribution, release

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "docs" / "book"
MATHJAX_VERSION = "3.2.2"
# The parts of MathJax's es5 build a page can load: the TeX→HTML bundle, its fonts, the TeX extensions it
# autoloads, and the context menu.
MATHJAX_PARTS = ("tex-chtml.js", "output/chtml/fonts/woff-v2", "input/tex/extensions", "ui")
DEFAULT_REPO = "https://github.com/dp-from-scratch/dp-from-scratch-student"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"   # the site serves its own copy
WIDGET_NOTE = ('<p class="widget-note"><strong>Interactive widget:</strong> its controls need a live kernel '
               '(use <em>Open in Colab</em> at the top of the page, or run the notebook). What it showed when the '
               'lesson was executed, at its default values:</p>')

FRONT_PAGE_TOC = """

```{{toctree}}
:hidden:
:caption: Lessons

{lessons}
```

```{{toctree}}
:hidden:
:caption: Labs (student copies)

{labs}
```

```{{toctree}}
:hidden:
:caption: Guides

README
INSTRUCTORS
```
"""


def fetch_mathjax(cache: Path) -> Path:
    """MathJax's es5 folder, from npm's tarball of MATHJAX_VERSION (downloaded once into `cache`)."""
    folder = cache / f"mathjax-{MATHJAX_VERSION}"
    if (folder / "tex-chtml.js").is_file():
        return folder
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("make book needs npm to fetch MathJax once (Debian: apt-get install npm), "
                         f"or unpack mathjax@{MATHJAX_VERSION}'s package/es5 into {folder}")
    cache.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "pack", f"mathjax@{MATHJAX_VERSION}", "--silent", "--pack-destination", str(cache)],
                          capture_output=True, text=True, timeout=300)
    tarball = cache / f"mathjax-{MATHJAX_VERSION}.tgz"
    if done.returncode != 0 or not tarball.is_file():
        raise SystemExit(f"npm could not fetch mathjax@{MATHJAX_VERSION}: {done.stderr.strip()[-500:]}")
    staging = cache / "unpacking"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(staging, filter="data")
    shutil.rmtree(folder, ignore_errors=True)
    (staging / "package" / "es5").rename(folder)
    shutil.rmtree(staging)
    tarball.unlink()
    return folder


def copy_mathjax(es5: Path, static: Path) -> None:
    """The parts of MathJax the pages load, into the site's _static/mathjax/."""
    for part in MATHJAX_PARTS:
        source, target = es5 / part, static / "mathjax" / part
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)


def widget_html(model_id: str, state: dict) -> str:
    """A widget's stored state as static HTML: each control's description and value, each HTML output."""
    model = state.get(model_id.removeprefix("IPY_MODEL_"), {})
    name, values = model.get("model_name", ""), model.get("state", {})
    if "children" in values:
        return "".join(widget_html(child, state) for child in values["children"])
    label = html.escape(str(values.get("description", "")))
    if name in ("HTMLModel", "HTMLMathModel"):
        return f'<div class="widget-stored">{values.get("value", "")}</div>'
    if name in ("DropdownModel", "ToggleButtonsModel", "RadioButtonsModel", "SelectModel"):
        labels, index = values.get("_options_labels", []), values.get("index")
        shown = labels[index] if isinstance(index, int) and index < len(labels) else ""
        return f'<div class="widget-stored">{label} <code>{html.escape(str(shown))}</code></div>'
    if "value" in values:
        return f'<div class="widget-stored">{label} <code>{html.escape(str(values["value"]))}</code></div>'
    return ""


def prepare_notebook(notebook: Path) -> int:
    """Put WIDGET_NOTE before every widget output of `notebook` and point its Colab badge at the site's own
    image (the page must not load one from another host); return how many widgets it marked."""
    nb = json.loads(notebook.read_text())
    state = nb.get("metadata", {}).get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    state = state.get("state", {})
    marked = 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            cell["source"] = "".join(cell["source"]).replace(COLAB_BADGE, "../_static/colab-badge.svg")
        outputs = []
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(output)
                continue
            stored = widget_html(view.get("model_id", ""), state)
            outputs.append({"output_type": "display_data", "metadata": {},
                            "data": {"text/html": WIDGET_NOTE + stored, "text/plain": "(interactive widget)"}})
            marked += 1
        if "outputs" in cell:
            cell["outputs"] = outputs
    notebook.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return marked


def write_sources(src: Path, student_repo: str, branch: str, mathjax_cache: Path) -> None:
    """The Sphinx source folder: the student distribution, the front page, the guides, images, MathJax."""
    distribution.write_distribution(src, student_repo, branch)
    lessons = sorted(p.relative_to(src).with_suffix("").as_posix() for p in (src / "lessons").glob("*.ipynb"))
    labs = sorted(p.relative_to(src).with_suffix("").as_posix() for p in (src / "labs").glob("*.ipynb"))
    front = (ROOT / "README.md").read_text()
    (src / "index.md").write_text(front + FRONT_PAGE_TOC.format(lessons="\n".join(lessons), labs="\n".join(labs)))
    shutil.copy2(ROOT / "INSTRUCTORS.md", src / "INSTRUCTORS.md")
    shutil.copytree(ROOT / "docs" / "img", src / "docs" / "img", dirs_exist_ok=True)
    for notebook in sorted(src.glob("l*/*.ipynb")):
        prepare_notebook(notebook)
    (src / "_static").mkdir(exist_ok=True)
    shutil.copy2(CONF / "colab-badge.svg", src / "_static" / "colab-badge.svg")
    copy_mathjax(fetch_mathjax(mathjax_cache), src / "_static")


def build(out: Path, student_repo: str = DEFAULT_REPO, branch: str = "main", quiet: bool = True) -> float:
    """Write the sources and run sphinx-build into `out`; return the seconds it took. Raises on a warning."""
    start = time.perf_counter()
    src = out.parent / f"{out.name}-src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    write_sources(src, student_repo, branch, out.parent / ".cache")
    env = {**os.environ, "BOOK_STUDENT_REPO": student_repo, "BOOK_BRANCH": branch, "BOOK_STATIC": str(src / "_static")}
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-c", str(CONF), str(src),
               str(out)] + (["-q"] if quiet else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"sphinx-build failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return time.perf_counter() - start


def site_bytes(out: Path) -> int:
    """The size of the built site on disk, in bytes."""
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tools.book", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/book"))
    parser.add_argument("--student-repo", default=DEFAULT_REPO,
                        help="the students' repository the Colab and download links open (as make distribution)")
    parser.add_argument("--branch", default="main")
    args = parser.parse_args(argv)
    try:
        release.check_student_repo(args.student_repo, args.branch)
    except ValueError as exc:
        parser.error(str(exc))
    seconds = build(args.out.resolve(), args.student_repo.rstrip("/"), args.branch)
    size = site_bytes(args.out)
    print(f"built {args.out}/index.html in {seconds:.0f} s: {size / 1e6:.1f} MB, links to {args.student_repo} "
          f"(branch {args.branch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
