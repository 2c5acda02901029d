"""The leak check: no line of a lab's reference solution or hidden tests in a body of published text.

Used on the student distribution (tests/test_distribution.py) and on the website built from it
(tests/test_book.py). `texts` maps a file's name to its text (a notebook: its cells' sources and outputs;
a web page: its visible text); `find_leaks(texts)` returns one sentence per leak found (empty when clean).
"""
import json
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

from utils.tools import release

ROOT = Path(__file__).resolve().parents[1]

# Each lab's distinctive solution lines (stripped): none may appear anywhere in published text. Lines a lesson
# rightly teaches (lesson 03's ring, lesson 04's hooks) are not distinctive and are left out.
DISTINCTIVE = {
    "lab1_collectives": [
        "outgoing, incoming = chunks[(rank - 1 - step) % n], chunks[(rank - 2 - step) % n]",
        "outgoing, incoming = pieces[(rank - step) % n], pieces[(rank - step - 1) % n]",
        "pieces[rank].copy_(chunk)",
        "return 2 * position + 1 if position < extra else position + extra",
        "keep, give = ((lo, mid), (mid, hi)) if me & distance == 0 else ((mid, hi), (lo, mid))",
        "other = (hi, outer_hi) if lo == outer_lo else (outer_lo, lo)",
        "return 2 * (n - 1) * (alpha + nbytes / n * beta)",
        "time = 2 * steps * alpha + 2 * (p - 1) / p * nbytes * beta",
        "latency_saved = (ring_time(n, 0, 1, 0) - halving_doubling_time(n, 0, 1, 0)) * alpha",
        "bandwidth_lost = (halving_doubling_time(n, 1, 0, 1) - ring_time(n, 1, 0, 1)) * beta",
    ],
    "lab2_ddp": [
        "self.filled_bytes += param.grad.numel() * param.grad.element_size()",
        "if self.filled_bytes >= self.cap_bytes or self.ready == len(self.params):",
        "flat = torch.cat([g.flatten() for g in grads]).div_(self.world_size)",
        "self.in_flight.append((work, flat, grads))",
    ],
    "lab3_sharded_optimizer": [
        "owner = min(range(self.world_size), key=lambda r: self.loads[r])",
        "self.loads[owner] += p.numel() if p.requires_grad else 0",
        'self.shard = self.optimizer_cls([{**options, "params": mine}], **self.kwargs)',
        'shard_group.update({k: v for k, v in group.items() if k != "params"})',
        "dist.broadcast(p.detach(), src=self.owner[p])",
    ],
}

class _Text(HTMLParser):
    """The text a browser shows of an HTML page (scripts and styles left out)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self._skip = [], 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style") and self._skip > 0

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)

def text_of(path: Path) -> str:
    """A published file's text: a notebook's sources and outputs, a page's visible text, else the file."""
    raw = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        nb = json.loads(raw)
        return "\n".join("".join(c["source"]) + "\n" + json.dumps(c.get("outputs", [])) for c in nb["cells"])
    if path.suffix == ".html":
        parser = _Text()
        parser.feed(raw)
        return unescape("".join(parser.parts))
    return raw

def texts(root: Path, suffixes=None) -> dict:
    """{relative path: text_of(file)} of every file under `root` (outside .git), or of those with `suffixes`."""
    return {p.relative_to(root).as_posix(): text_of(p) for p in sorted(root.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(root).parts and (suffixes is None or p.suffix in suffixes)}

def find_leaks(everything: dict, labs_folder: Path = ROOT / "labs") -> list:
    """Sentences naming each reference-solution region, hidden-test line or distinctive line found in the texts."""
    found = []
    lines = {line.strip() for text in everything.values() for line in text.splitlines()}
    for lab, distinctive in DISTINCTIVE.items():
        nb = release.read_notebook(labs_folder / f"{lab}.ipynb")
        solution_lines = set()
        for cell in nb.cells:
            source = cell.source.split("\n")
            for what in (release.SOLUTION, release.HIDDEN_TESTS):
                for begin, end, _ in release.marker_regions(cell.source, what):
                    region = "\n".join(source[begin + 1:end]).strip()
                    # a one-line region (lab 2's `return self.module(*args, **kwargs)`) is common code; the
                    # curated lines cover the one-line formulas
                    if region.count("\n") and [n for n, t in everything.items() if region in t]:
                        found.append(f"{lab}: a whole {what} region in {[n for n, t in everything.items() if region in t]}")
                    if what == release.HIDDEN_TESTS:  # every line of a hidden test is the instructor's
                        leaked = {l.strip() for l in source[begin + 1:end]} & lines - {""}
                        if leaked:
                            found.append(f"{lab}: hidden test lines {sorted(leaked)}")
                    solution_lines |= {l.strip() for l in source[begin + 1:end]}
        stale = [line for line in distinctive if not any(line in s for s in solution_lines)]
        if stale:
            found.append(f"{lab}: DISTINCTIVE lines no longer in its solutions (update tests/leakcheck.py): {stale}")
        leaked = [line for line in distinctive if line in lines or any(line in t for t in everything.values())]
        if leaked:
            found.append(f"{lab}: distinctive solution lines {leaked} in "
                         f"{sorted(n for n, t in everything.items() if any(l in t for l in leaked))}")
    return found
