"""What travels between the notebook and its ranks: functions and results by value, exceptions as frames.

`dumps` pickles with cloudpickle (a function or class defined in a notebook cell travels by value; modules
travel as imports by name); `to_cpu` moves tensors in results to the CPU; `describe_exception` turns a rank's
exception into plain data the launcher formats (utils/reports.py).
"""
from __future__ import annotations

import importlib
import io
import pickle
import sys
import traceback
import types

import cloudpickle
import torch


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus: anything registered in sys.modules travels as an import by name.

    cloudpickle ships a module global's submodules that the function's names mention; some torch
    "modules" (e.g. torch.distributed.config) are objects it cannot pickle, so a notebook global
    named `config` would otherwise break a launch.
    """

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    """Pickle `obj` the way launch() ships functions and results (by value, modules by name)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def describe_exception(exc):
    """What the launcher needs to show a remote traceback: type, message and raw frames."""
    frames = [(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_tb(exc.__traceback__)]
    return {"type": type(exc).__name__, "message": str(exc), "frames": frames}


def to_cpu(value):
    """Move tensors in (nested) lists, tuples and dicts to the CPU before they travel."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    return value
