"""Shared plumbing for the course *Data Parallelism from Scratch*.

The notebooks import what they need from here:
    utils.launch(fn, world_size=4)      run fn on 4 ranks, get their results (utils/launching.py)
    utils.device()                      this rank's torch.device
    %load_ext utils; %%distributed -n 4 run a cell on 4 ranks (utils/magic.py)
    %dist start -n 4                    ranks that stay alive across cells (utils/pool.py)
    utils.launch(fn, replace=1)         a dead rank replaced by a new process; utils.replacement forms the
                                        survivors' and the newcomer's fresh groups
    utils.trace, utils.plots            per-rank timelines
    utils.checks                        state a claim: print ✓ or raise
    utils.compat                        torch API that changed across supported releases (one bridge)
    utils.timing                        interleaved timings, their spread, honest verdicts
    utils.pairing                       balanced A/B and A/A visits; a paired, stratified sign-flip test
    utils.ring_model                    the α–β–γ model of a (pipelined) ring all-reduce
"""
from .launching import (LaunchError, LaunchTimeout, backend_for, default_threads, describe, device,
                        launch)
from . import checks, compat, trace

__all__ = ["launch", "device", "describe", "backend_for", "default_threads", "LaunchError",
           "LaunchTimeout", "checks", "compat", "trace", "load_ipython_extension"]


def _register_requires():
    """In IPython, `%%requires NAME` (utils.compat.requires): a cell shown only on a torch that has NAME."""
    import sys
    if "IPython" not in sys.modules:  # not in a notebook (a rank, a script): nothing to register
        return
    shell = sys.modules["IPython"].get_ipython()
    if shell is not None:
        shell.register_magic_function(compat.requires, "cell", "requires")


_register_requires()


def load_ipython_extension(ipython):
    """`%load_ext utils` registers the `%%distributed` cell magic and the `%dist` line magic."""
    from .magic import DistributedMagics
    ipython.register_magics(DistributedMagics)


# In a notebook, start the forkserver's `import torch` now, in the background, so that the lesson's first
# launch a few cells later costs about as much as any other (utils/warmup.py says when it does not run).
from . import warmup as _warmup  # noqa: E402
_warmup.start_in_notebook()
