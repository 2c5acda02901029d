"""`%%distributed -n 4`: run a notebook cell on every rank.

    %load_ext utils
    %%distributed -n 4
    t = torch.ones(3) * dist.get_rank()
    dist.all_reduce(t)
    t                       # the last expression's value, per rank, is kept in `distributed_results`

The names the cell uses that exist in the notebook (data, functions, imported modules) travel to
the ranks by value; everything the cell assigns stays in the ranks.
"""
import ast
import linecache

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .launching import dumps, launch

_CELL_FILE = "<distributed cell>"


def names_used(source: str) -> set:
    """Every name the code loads, including inside functions and classes it defines."""
    names = set()

    def walk(code):
        names.update(code.co_names)
        names.update(code.co_varnames)
        names.update(code.co_freevars)
        for const in code.co_consts:
            if hasattr(const, "co_names"):
                walk(const)

    walk(compile(source, _CELL_FILE, "exec"))
    return names


def ends_with_expression(tree: ast.Module) -> bool:
    """Whether a cell's last statement is an expression (Jupyter then shows its value)."""
    return bool(tree.body) and isinstance(tree.body[-1], ast.Expr)


def run_cell_source(source: str, namespace: dict):
    """Execute a cell's source in `namespace`; return the last expression's value, if any."""
    linecache.cache[_CELL_FILE] = (len(source), None, source.splitlines(True), _CELL_FILE)
    tree = ast.parse(source)
    last = tree.body.pop() if ends_with_expression(tree) else None
    exec(compile(tree, _CELL_FILE, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), _CELL_FILE, "eval"), namespace)


@magics_class
class DistributedMagics(Magics):
    """The `%%distributed` cell magic."""

    @magic_arguments()
    @argument("-n", "--world-size", type=int, default=4, help="number of ranks (default 4)")
    @argument("--backend", default="auto", help="auto, gloo or nccl")
    @argument("--timeout", type=float, default=60.0, help="seconds before a hang is reported")
    @argument("-o", "--out", default="distributed_results",
              help="notebook variable that receives the per-rank results")
    @cell_magic
    def distributed(self, line, cell):
        """Run this cell on N ranks with the default process group initialised."""
        args = parse_argstring(self.distributed, line)
        user_ns = self.shell.user_ns
        namespace = {}
        for name in names_used(cell):
            if name in user_ns and not name.startswith("_"):
                try:  # a value that cannot travel is left behind; the cell then names it in a NameError
                    dumps(user_ns[name])
                except Exception:
                    continue
                namespace[name] = user_ns[name]
        results = launch(run_cell_source, cell, namespace, world_size=args.world_size,
                         backend=args.backend, timeout=args.timeout)
        user_ns[args.out] = results
        return results if ends_with_expression(ast.parse(cell)) else None
