"""Weight copies for the decode kernels: kept per module between calls, dropped when the weight changes.

Boundary: a process-wide store weakly keyed by ``nn.Linear`` (copies die with their model) plus the memory
figures the budget needs. Knows nothing about timing; the caller says which kernels are still worth a copy.

A copy is stale when its module's weight is another Parameter, points at other memory or with another
shape or strides (an alias of the old storage is kept, so its address cannot be reused by a new tensor), was
changed in place (the version counter; inference tensors have none), or was written through ``.data``
(which bumps no counter, e.g. merging a LoRA adapter): for that, 16 values of the weight are compared with a
snapshot each time a context opens. A change none of these sees (an in-place write to an inference tensor
while a context is open) needs ``release_decode_kernels(model)``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

_SAMPLED_VALUES = 16


@dataclass(frozen=True)
class WeightStamp:
    """Which weight tensor something was derived from, cheap to check on every call."""

    param: weakref.ref  # the Parameter object
    alias: torch.Tensor  # shares the weight's storage: keeps its address from being reused while we compare it
    identity: tuple  # (data_ptr, version or None for inference tensors, shape, strides)

    @classmethod
    def of(cls, weight: torch.Tensor) -> WeightStamp:
        return cls(weakref.ref(weight), weight.detach(), _identity(weight))

    def matches(self, weight: torch.Tensor) -> bool:
        """Still the same Parameter, memory, shape, strides and (in-place) version."""
        return self.param() is weight and self.identity == _identity(weight)


@dataclass
class _Entry:
    """One module's copies and the weight they were made from."""

    stamp: WeightStamp
    key: tuple  # the trials' shape key (model, shape, threads) the copies serve
    snapshot: torch.Tensor  # [_SAMPLED_VALUES] weight values at fixed flat positions
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


_STORE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Linear -> _Entry


def _identity(weight: torch.Tensor) -> tuple:
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), version, tuple(weight.shape), weight.stride()


def _snapshot(weight: torch.Tensor) -> torch.Tensor:
    flat = weight.detach().reshape(-1)
    positions = torch.arange(_SAMPLED_VALUES) * (flat.numel() - 1) // (_SAMPLED_VALUES - 1)  # integer: exact
    with torch.inference_mode(False):
        return flat[positions].clone()


def _current(module: nn.Linear) -> _Entry | None:
    """The module's entry if its copies still match the weight (cheap checks, every call); drops stale ones."""
    entry = _STORE.get(module)
    if entry is not None and not entry.stamp.matches(module.weight):
        del _STORE[module]
        return None
    return entry


def verify(module: nn.Linear) -> None:
    """Also compare the sampled values (catches writes through ``.data``); called when a context opens."""
    entry = _current(module)
    if entry is not None and not torch.equal(entry.snapshot, _snapshot(module.weight)):
        del _STORE[module]


def get(module: nn.Linear, kernel: str, key: tuple) -> torch.Tensor | None:
    """The module's copy for ``kernel``, if current; the copies now serve trials of ``key``."""
    entry = _current(module)
    if entry is None:
        return None
    entry.key = key
    return entry.tensors.get(kernel)


def add(module: nn.Linear, kernel: str, copy: torch.Tensor, key: tuple) -> None:
    entry = _current(module)
    if entry is None:
        weight = module.weight
        entry = _STORE[module] = _Entry(WeightStamp.of(weight), key, _snapshot(weight))
    entry.tensors[kernel] = copy


def prune(key: tuple, keep: set[str]) -> int:
    """Drop the copies of kernels outside ``keep`` for every module of shape ``key``; returns bytes freed."""
    freed = 0
    for module, entry in list(_STORE.items()):
        if entry.key == key:
            for kernel in [k for k in entry.tensors if k not in keep]:
                del entry.tensors[kernel]
                freed += nbytes(module)
    return freed


def release(module: nn.Module) -> int:
    """Drop every copy of one module; returns bytes freed."""
    entry = _STORE.pop(module, None)
    return 0 if entry is None else len(entry.tensors) * nbytes(module)


def held_bytes() -> int:
    return sum(len(entry.tensors) * nbytes(module) for module, entry in list(_STORE.items()))


def kernels_held(module: nn.Module) -> set[str]:
    entry = _STORE.get(module)
    return set() if entry is None else set(entry.tensors)


def nbytes(module: nn.Module) -> int:
    """Bytes of one weight copy of ``module`` (a copy is the size of its weight)."""
    return module.weight.numel() * module.weight.element_size()


def available_bytes() -> int:
    """Memory this process may still use: ``MemAvailable``, capped by a cgroup v2 limit when there is one."""
    available = 1 << 62
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available
