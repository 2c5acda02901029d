"""Memory accounting by category, measured on the live tensors.

Bytes are counted per *storage* (the memory block behind a tensor), not per
tensor: views and shared weights (tied embeddings) point at one storage and are
counted once, which is what the allocator actually holds. Categories:

- parameters: the storages of ``model.parameters()``
- gradients: the storages of every ``p.grad``
- optimizer state: every tensor in ``optimizer.state`` (AdamW: exp_avg,
  exp_avg_sq and a scalar ``step`` per parameter)
- activations: tensors autograd saved for backward during a forward pass,
  caught with ``torch.autograd.graph.saved_tensors_hooks`` (works on CPU and GPU;
  parameters and buffers that autograd also saves are not activations and are
  left out)
- buffers: non-parameter module state (e.g. a causal mask)

``zero_model_state_bytes`` is the formula side: per-rank model-state bytes of DDP and ZeRO stages 1–3.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = [
    "storage_key", "unique_storage_bytes", "naive_bytes", "parameter_bytes", "gradient_bytes",
    "optimizer_state_bytes", "buffer_bytes", "saved_activations", "memory_by_category", "format_bytes",
    "zero_model_state_bytes",
]


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the storage behind ``t``: (device, address of its first byte)."""
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def _storages(tensors: Iterable[torch.Tensor]) -> dict[tuple[str, int], int]:
    """Map storage key -> storage size in bytes, each storage once."""
    out: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        out[storage_key(t)] = s.nbytes()
    return out


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by the distinct storages behind ``tensors`` (views and shared tensors count once;
    a view counts its whole storage, since that is what stays allocated)."""
    return sum(_storages(tensors).values())


def naive_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """numel x element size summed over ``tensors`` -- what you get if you forget sharing."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameter storages."""
    return unique_storage_bytes(model.parameters())


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradient storages currently attached to the model's parameters (0 after zero_grad(set_to_none=True))."""
    return unique_storage_bytes(p.grad for p in model.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state (empty before the first step)."""
    tensors = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return unique_storage_bytes(tensors)


def buffer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's buffers (state that is not trained, e.g. masks, BatchNorm statistics)."""
    return unique_storage_bytes(model.buffers())


class saved_activations:
    """Context manager that records the storages autograd saves for backward.

    >>> with saved_activations(model) as acts:
    ...     loss = model(x, y)
    >>> acts.bytes            # bytes held for backward at the end of the forward pass

    Storages of ``exclude`` (by default the parameters and buffers of the
    modules given) are not activations and are skipped. Use it around one
    forward pass: all tensors saved in it are alive together until backward,
    so their storages are distinct and the sum is what the pass holds.
    """

    def __init__(self, *modules: torch.nn.Module, exclude: Iterable[torch.Tensor] = ()):
        tensors = list(exclude)
        for m in modules:
            tensors += list(m.parameters()) + list(m.buffers())
        self._excluded = set(_storages(tensors))
        self.storages: dict[tuple[str, int], int] = {}
        self.dtypes: dict[tuple[str, int], torch.dtype] = {}   # storage -> dtype of the tensor saved
        self.num_saved = 0          # tensors autograd saved (including repeats and excluded ones)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.num_saved += 1
        for key, nbytes in _storages([t]).items():
            if key not in self._excluded:
                self.storages[key] = nbytes
                self.dtypes[key] = t.dtype
        return t                     # keep autograd's normal behaviour: save the tensor itself

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def bytes(self) -> int:
        """Distinct bytes saved for backward."""
        return sum(self.storages.values())

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        """Distinct bytes saved for backward, per dtype name ('float32', 'int64', ...)."""
        out: dict[str, int] = {}
        for key, nbytes in self.storages.items():
            name = str(self.dtypes[key]).removeprefix("torch.")
            out[name] = out.get(name, 0) + nbytes
        return out

    def __enter__(self) -> "saved_activations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def memory_by_category(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                       activations: int = 0) -> dict[str, int]:
    """Bytes per category right now: parameters, gradients, optimizer state,
    activations (pass the figure a ``saved_activations`` measured) and buffers."""
    return {
        "parameters": parameter_bytes(model),
        "gradients": gradient_bytes(model),
        "optimizer state": optimizer_state_bytes(optimizer) if optimizer is not None else 0,
        "activations": int(activations),
        "buffers": buffer_bytes(model),
    }


def format_bytes(n: float) -> str:
    """Human-readable bytes with binary prefixes, e.g. 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def zero_model_state_bytes(num_params: int, world_size: int, stage: int, optimizer_bytes_per_param: int = 12,
                           param_bytes: int = 2, grad_bytes: int = 2) -> float:
    """Per-rank bytes of model state (parameters + gradients + optimizer state) under ZeRO.

    Ψ = num_params, N = world_size, K = optimizer_bytes_per_param; stage 0 is plain DDP (nothing sharded):

    - stage 0: (P + G + K)·Ψ            every rank holds everything
    - stage 1: (P + G)·Ψ + K·Ψ/N        optimizer state sharded
    - stage 2: P·Ψ + (G + K)·Ψ/N        gradients sharded too
    - stage 3: (P + G + K)·Ψ/N          parameters sharded too

    The defaults are the ZeRO paper's mixed-precision Adam: fp16 parameters and gradients (P = G = 2) and
    K = 12 bytes of optimizer state (fp32 master weights, momentum, variance). fp32 training, as on a CPU:
    param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=8 (Adam's two moments). Returns the exact value
    (a float where N does not divide the sharded part); activations and buffers are not model state.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size}, {num_params}")
    replicated = (param_bytes + grad_bytes + optimizer_bytes_per_param, param_bytes + grad_bytes, param_bytes, 0)[stage]
    sharded = param_bytes + grad_bytes + optimizer_bytes_per_param - replicated
    return replicated * num_params + sharded * num_params / world_size
