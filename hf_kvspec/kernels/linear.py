"""Decode kernels: ``nn.Linear`` calls with few rows, on CPU, through the fastest of three measured kernels.

Boundary: swaps the ``forward`` of eligible ``nn.Linear`` instances while a ``DecodeKernels`` context is open and
puts it back on exit; weights, state dicts and every other module are untouched. The kernels are in ``ops.py``,
the choice per shape and row bucket in ``trials.py``, the weight copies in ``copies.py``.

Opt-in: ``speculative_generate(..., decode_kernels=True)`` or ``with hf_kvspec.decode_kernels(model): ...``;
nothing imports this package unless asked. The stock path (``F.linear``) is the reference.

Why: decoding runs linear layers on 1 row (plain decode, draft forwards) or on a handful of rows (a
speculative verify forward: ``K + 1`` rows per sequence). On CPUs where torch's stock ``F.linear`` (MKL sgemm)
is slow for 2-16 rows, a verify forward can cost about twice a 1-row forward, which eats the gain of
speculation. Which kernel wins depends on the CPU, the shape and the row count, so nothing is hard-coded: the
choice is timed on the first real calls (``trials.py``). Per-shape timings on the machine this project
benchmarks on: docs/speculative.md, "Decode kernels (opt-in, CPU)".

Eligible: exactly ``nn.Linear`` (not subclasses such as quantized linears), fp32 weight on CPU, no other
instance-level ``forward`` (e.g. accelerate hooks). Per call, stock runs when autograd is needed, under CPU
autocast, while ``torch.compile`` traces, for other dtypes or devices, and above ``max_rows`` rows.
The swap belongs to the model, not to a thread: another thread's calls on the same model see it too.

Memory: each copy is the size of its weight. While a bucket is being timed the few layers of a shape that are
timed (``trials.PROBES``) may hold a transposed and a oneDNN copy; afterwards only the kernels some bucket of its
shape chose stay (the LM head may keep both: one for 1 row, one for several). A context never lets the copies of all models exceed ``memory_fraction`` of the
memory available when it opened (plus what copies already held); past that a layer stays stock, with one
warning. Reproducibility: which kernel wins is timed on this machine, so fp32 rounding (and, in near ties, a
greedy token) can differ between machines or runs; ``force=`` or ``decode_kernels=False`` pins the kernel.

Shapes: ``R`` rows (all leading dims flattened), ``I`` in features, ``O`` out features.
"""

from __future__ import annotations

import functools
import time
import warnings
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_kvspec.kernels import copies
from hf_kvspec.kernels.ops import KERNELS, available_kernels, make_copy, onednn_available, run
from hf_kvspec.kernels.trials import BUCKETS, Trial, bucket_of, group_label, kernels_in_use, plans, shape_key, trial_for

__all__ = ["KERNELS", "DecodeKernels", "decode_kernels", "onednn_available", "plans", "release_decode_kernels"]

_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Linear -> open contexts, innermost last


class _Settled(NamedTuple):
    """A module's kernel for one row count that no longer changes, and what it was settled for."""

    kernel: str
    copy: torch.Tensor | None
    stamp: copies.WeightStamp
    threads: int


class DecodeKernels:
    """``with DecodeKernels(model, draft): ...`` - small-row fp32 CPU ``nn.Linear`` calls use the fastest kernel.

    Args:
        *models: modules whose ``nn.Linear`` submodules may switch kernels (a target, a draft model).
        max_rows: calls with more rows (prefill) always run stock; at most 64 (the last timed bucket).
        memory_fraction: the most all weight copies may take, as a fraction of the memory available when the
            context opens (plus what copies already held).
        force: one of ``KERNELS`` for every eligible call instead of timing (tests, reproducibility).
        min_weight_elements: smaller layers stay stock (their calls take microseconds; the swap's own Python
            costs about as much as any kernel could save there).

    Contexts may be nested, overlap on the same model (the innermost open one decides) and an instance may be
    re-entered; each swap is undone when the last context using the module closes.
    """

    def __init__(self, *models: nn.Module, max_rows: int = 64, memory_fraction: float = 0.25,
                 force: str | None = None, min_weight_elements: int = 1 << 16):
        _require_models(models)
        if not (_is_int(max_rows) and 1 <= max_rows <= BUCKETS[-1][1]):
            raise ValueError(f"max_rows must be an int in 1..{BUCKETS[-1][1]}, got {max_rows!r}")
        if not (isinstance(memory_fraction, (int, float)) and 0 <= memory_fraction <= 1):
            raise ValueError(f"memory_fraction must be in [0, 1] (a share of the available memory), got "
                             f"{memory_fraction!r}")
        if not (_is_int(min_weight_elements) and min_weight_elements >= 0):
            raise ValueError(f"min_weight_elements must be >= 0 (an int; 0 swaps every eligible layer), got "
                             f"{min_weight_elements!r}")
        if force is not None and force not in KERNELS:
            raise ValueError(f"force must be one of {KERNELS} or None, got {force!r}")
        if force == "onednn" and not onednn_available():
            raise RuntimeError("force='onednn' but this torch build has no working oneDNN linear ops "
                               "(torch.backends.mkldnn); use force='transposed' or leave force=None.")
        self.models, self.max_rows, self.force = models, max_rows, force
        self.memory_fraction, self.min_weight_elements = memory_fraction, min_weight_elements
        self.modules: list[nn.Linear] = []
        self.resolved: dict[tuple[int, int], _Settled] = {}  # (id(module), rows) -> settled kernel
        self.groups: dict[int, str] = {}  # id(module) -> label of the model it was reached from
        self.allocated = 0  # bytes of weight copies this context made
        self.calls = dict.fromkeys(KERNELS, 0)  # linear calls per kernel while this context was innermost
        self._budget = 0
        self._depth = 0
        self._warned = False

    def __enter__(self) -> DecodeKernels:
        self._depth += 1
        if self._depth > 1:
            return self
        self._budget = int(self.memory_fraction * (copies.available_bytes() + copies.held_bytes()))
        for model in self.models:
            for module in model.modules():
                if _eligible(module, self.min_weight_elements) and id(module) not in self.groups:
                    copies.verify(module)
                    self.modules.append(module)
                    self.groups[id(module)] = group_label(model)
                    _install(module, self)
                elif isinstance(module, nn.Linear) and module not in _INSTALLED:
                    copies.release(module)  # e.g. moved to another device or dtype since its copies were made
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for module in self.modules:
            _uninstall(module, self)
        self.modules, self.resolved, self.groups = [], {}, {}

    # ------------------------------------------------------------------------------ per call
    def kernel_for(self, module: nn.Linear, rows: int) -> tuple[str, torch.Tensor | None, Trial | None]:
        """The kernel for a call of ``rows`` rows, its weight copy, and the trial to report the call's time to
        while the bucket is still being timed (``("stock", None, None)`` when no other kernel applies)."""
        bucket = bucket_of(rows) if rows <= self.max_rows else None
        key = shape_key(module, self.groups.get(id(module), ""))
        kernel, trial, final = "stock", None, True  # final: this module's kernel for ``rows`` no longer changes
        if bucket is not None and self.force is not None:
            kernel = self.force
        elif bucket is not None:
            pending = trial_for(key, bucket, available_kernels())
            timed = None if pending.chosen else pending.next_kernel(module)
            kernel = pending.chosen or timed or "stock"
            trial, final = (pending, False) if timed else (None, pending.chosen is not None)
        copy = None if kernel == "stock" else self._copy(module, kernel, key)
        if kernel != "stock" and copy is None:  # no room for the copy: this call runs stock
            if trial is not None and trial.drop(kernel):
                settle(key)
            kernel, trial = "stock", None
        if final:  # later calls of this module with as many rows skip the lookups (``_resolved``)
            self.resolved[id(module), rows] = _Settled(kernel, copy, copies.WeightStamp.of(module.weight),
                                                       torch.get_num_threads())
        self.calls[kernel] += 1
        return kernel, copy, trial

    def _copy(self, module: nn.Linear, kernel: str, key: tuple) -> torch.Tensor | None:
        copy = copies.get(module, kernel, key)
        if copy is None:
            size = copies.nbytes(module)
            if copies.held_bytes() + size > self._budget:
                self._warn_memory(size)
                return None
            copy = make_copy(kernel, module.weight)
            copies.add(module, kernel, copy, key)
            self.allocated += size
        return copy

    def _warn_memory(self, size: int) -> None:
        if not self._warned:
            warnings.warn(f"DecodeKernels: a {size / 2**20:.0f} MiB weight copy would exceed "
                          f"memory_fraction={self.memory_fraction} of the available memory; that layer keeps "
                          "torch's stock kernel (slower, same results). Raise memory_fraction or free memory.",
                          RuntimeWarning, stacklevel=5)
            self._warned = True


def decode_kernels(*models: nn.Module, **kwargs) -> DecodeKernels:
    """Shorthand for ``DecodeKernels(*models, **kwargs)``: ``with hf_kvspec.decode_kernels(model): ...``."""
    return DecodeKernels(*models, **kwargs)


def release_decode_kernels(*models: nn.Module) -> int:
    """Free the weight copies kept for these models' linear layers; returns the bytes freed."""
    _require_models(models, "release_decode_kernels")
    return sum(copies.release(module) for model in models for module in model.modules())


def settle(key: tuple) -> None:
    """A bucket of this shape just chose: drop copies no bucket of the shape uses any more."""
    copies.prune(key, kernels_in_use(key))


def _require_models(models: tuple, name: str = "decode_kernels") -> None:
    bad = [type(model).__name__ for model in models if not isinstance(model, nn.Module)]
    if not models or bad:
        raise TypeError(f"{name} needs loaded models (torch.nn.Module), got {bad or 'none'}; pass the models "
                        "themselves (target, draft), not their configs.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------ install
def _eligible(module: nn.Module, min_elements: int) -> bool:
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and module.weight.dim() == 2
            and module.weight.numel() >= min_elements
            and ("forward" not in vars(module) or module in _INSTALLED))


def _install(module: nn.Linear, context: DecodeKernels) -> None:
    stack = _INSTALLED.setdefault(module, [])
    stack.append(context)
    if len(stack) == 1:
        module.forward = functools.partial(_forward, module)


def _uninstall(module: nn.Linear, context: DecodeKernels) -> None:
    stack = _INSTALLED.get(module)
    if stack is None or context not in stack:
        return
    stack.remove(context)  # this context's entry, wherever it is (contexts may close out of order)
    if not stack:
        del _INSTALLED[module]
        if getattr(vars(module).get("forward"), "func", None) is _forward:  # not a hook added meanwhile
            del module.forward  # the class's forward shows through again


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for ``x`` [..., I] -> [..., O] through the innermost open context's kernel."""
    weight, bias = module.weight, module.bias
    stack = _INSTALLED.get(module)  # empty for a deep copy made while swapped: it runs stock
    if not stack or _needs_stock(weight, bias, x):
        return F.linear(x, weight, bias)
    rows, context = x.numel() // weight.shape[1], stack[-1]
    hit = _resolved(context, module, weight, rows)
    if hit is not None:  # the fast path
        kernel, copy, trial = hit.kernel, hit.copy, None
        context.calls[kernel] += 1
    else:
        kernel, copy, trial = context.kernel_for(module, rows)
    if trial is None and kernel == "stock":
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, weight.shape[1]).contiguous()  # [R, I]
    start = time.perf_counter()
    out = run(kernel, flat, copy, bias, weight)  # [R, O]
    if trial is not None and trial.record(kernel, time.perf_counter() - start):
        settle(trial.key)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _resolved(context: DecodeKernels, module: nn.Linear, weight: torch.Tensor, rows: int) -> _Settled | None:
    """The settled kernel for this call if the weight is still the very tensor it was settled for (``WeightStamp``)
    and the thread count is unchanged."""
    hit = context.resolved.get((id(module), rows))
    if hit is None or not hit.stamp.matches(weight) or hit.threads != torch.get_num_threads():
        return None
    return hit


def _needs_stock(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> bool:
    needs_grad = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad
                                              or (bias is not None and bias.requires_grad))
    return (needs_grad or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling()
            or weight.dtype != torch.float32 or not weight.is_cpu  # converted while a context is open
            or x.dtype != weight.dtype or x.device != weight.device or x.shape[-1] != weight.shape[1])
