"""`%%distributed -n 4`: run a notebook cell on every rank; `%dist`: ranks that stay alive across cells.

    %load_ext utils
    %%distributed -n 4
    t = torch.ones(3) * dist.get_rank()
    dist.all_reduce(t)
    t                       # the last expression's value, per rank, is kept in `distributed_results`

Without a pool, each such cell starts fresh ranks: the names the cell uses that exist in the
notebook (data, functions, imported modules) travel to the ranks by value; everything the cell
assigns stays in the ranks, and ends with them.

With a pool (`%dist start -n 4`, utils/pool.py), `%%distributed` runs the cell on the pool's ranks,
each keeping its own variables from cell to cell; a notebook name travels only to a rank that lacks
it. `%%distributed --ranks 0,2` runs on some ranks (the others' entries in `distributed_results` are
None). `%dist get NAME` returns each rank's value, `%dist status` shows the ranks, `%dist stop` ends them.
"""
import ast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import pool
from .cells import ends_with_expression, names_used, run_cell_source  # noqa: F401 (names_used: public)
from .launching import dumps, launch


def notebook_names(cell: str, user_ns: dict) -> dict:
    """The notebook's values of the names the cell uses, where they can travel to a rank."""
    namespace = {}
    for name in names_used(cell):
        if name in user_ns and not name.startswith("_"):
            try:  # a value that cannot travel is left behind; the cell then names it in a NameError
                dumps(user_ns[name])
            except Exception:
                continue
            namespace[name] = user_ns[name]
    return namespace


def _parse_ranks(text):
    try:
        return sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise UsageError(f"--ranks takes rank numbers separated by commas, e.g. --ranks 0,2; got {text!r}") from None


@magics_class
class DistributedMagics(Magics):
    """The `%%distributed` cell magic and the `%dist` line magic."""

    @magic_arguments()
    @argument("-n", "--world-size", type=int, default=None, help="number of ranks (default 4, or the pool's)")
    @argument("--ranks", default=None, help="with a pool: run on these ranks only, e.g. 0,2")
    @argument("--backend", default="auto", help="auto, gloo or nccl")
    @argument("--timeout", type=float, default=60.0, help="seconds before a hang is reported")
    @argument("-o", "--out", default="distributed_results",
              help="notebook variable that receives the per-rank results")
    @cell_magic
    def distributed(self, line, cell):
        """Run this cell on N ranks with the default process group initialised (on the pool if one runs)."""
        args = parse_argstring(self.distributed, line)
        user_ns = self.shell.user_ns
        running = pool.current()
        if running is not None:
            if args.world_size not in (None, running.world_size):
                raise UsageError(f"a pool of {running.world_size} ranks is running and %%distributed runs cells "
                                 f"on it (--ranks picks some); %dist stop first for one-shot launches of "
                                 f"{args.world_size} ranks.")
            ranks = _parse_ranks(args.ranks) if args.ranks else None
            results = running.run_cell(cell, notebook_names(cell, user_ns), ranks=ranks, timeout=args.timeout)
            idle = sorted(set(range(running.world_size)) - set(ranks or range(running.world_size)))
            if idle:
                print(f"{args.out}: None for rank{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))}, "
                      "which did not run this cell")
        else:
            if args.ranks:
                raise UsageError("--ranks needs a pool of ranks that stay alive: %dist start -n 4 first.")
            results = launch(run_cell_source, cell, notebook_names(cell, user_ns),
                             world_size=args.world_size or 4, backend=args.backend, timeout=args.timeout)
        user_ns[args.out] = results
        return results if ends_with_expression(ast.parse(cell)) else None

    @magic_arguments()
    @argument("action", choices=("start", "status", "stop", "get"), help="what to do with the pool")
    @argument("name", nargs="?", help="with get: the variable to fetch from every rank")
    @argument("-n", "--world-size", type=int, default=4, help="with start: number of ranks (default 4)")
    @argument("--backend", default="auto", help="with start: auto, gloo or nccl")
    @argument("--grace", type=float, default=2.0,
              help="with start: seconds the other ranks get to finish a cell after one raised")
    @line_magic
    def dist(self, line):
        """%dist start -n 4 | status | get NAME | stop: a pool of ranks that stay alive across cells."""
        args = parse_argstring(self.dist, line)
        running = pool.current()
        if args.action == "start":
            if running is not None:
                running.stop()
                print(f"stopped the running pool of {running.world_size} ranks")
            started = pool.Pool(args.world_size, backend=args.backend, grace=args.grace)
            where = sorted(set(started.devices.values()))
            print(f"pool of {started.world_size} ranks started (backend '{started.backend}', "
                  f"{', '.join(where)}): %%distributed now runs cells on it")
            return None
        if running is None:
            raise UsageError("no pool is running: %dist start -n 4 starts one.")
        if args.action == "stop":
            running.stop()
            print(f"pool of {running.world_size} ranks stopped")
        elif args.action == "status":
            print(f"{'rank':>4}  {'state':5}  {'pid':>7}  {'device':8}  memory")
            for row in running.status():
                print(f"{row['rank']:>4}  {row['state']:5}  {row['pid']:>7}  {row['device']:8}  {row['memory']}")
        else:
            if not args.name:
                raise UsageError("%dist get NAME: which variable?")
            return running.get(args.name)
        return None
