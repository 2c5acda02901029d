"""A notebook cell's source run as code: the names it uses, and its last expression's value.

Shared by `%%distributed` (utils/magic.py), which ships a cell to fresh ranks, and the rank pool
(utils/pool.py), which runs it in ranks that stay alive. Kept free of IPython and torch so that a
rank can import it cheaply.
"""
import ast
import linecache

CELL_FILE = "<distributed cell>"  # the file name a cell's frames carry in tracebacks and stacks


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

    walk(compile(source, CELL_FILE, "exec"))
    return names


def ends_with_expression(tree: ast.Module) -> bool:
    """Whether a cell's last statement is an expression (Jupyter then shows its value)."""
    return bool(tree.body) and isinstance(tree.body[-1], ast.Expr)


def remember_source(source: str) -> None:
    """Put the cell's lines where tracebacks and stack reports look them up (linecache)."""
    linecache.cache[CELL_FILE] = (len(source), None, source.splitlines(True), CELL_FILE)


def run_cell_source(source: str, namespace: dict):
    """Execute a cell's source in `namespace`; return the last expression's value, if any."""
    remember_source(source)
    tree = ast.parse(source)
    last = tree.body.pop() if ends_with_expression(tree) else None
    exec(compile(tree, CELL_FILE, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), CELL_FILE, "eval"), namespace)
