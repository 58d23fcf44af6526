"""Decode kernels: few-row fp32 ``F.linear`` calls on CPU, routed to the fastest of three measured kernels.

Boundary: while a ``DecodeKernels`` context is open on a thread, a ``torch.overrides.TorchFunctionMode`` sees that
thread's ``F.linear`` calls and routes those whose weight belongs to an eligible ``nn.Linear`` of the context's
models; nothing on the user's modules changes (no ``forward`` is replaced, no hook added, weights and state dicts
untouched), and every other call, thread and model runs stock. The kernels are in ``ops.py``, the choice per
shape and row bucket in ``trials.py``, the weight copies in ``copies.py``.

On by default inside ``speculative_generate`` on CPU (``decode_kernels=False`` there keeps the stock path, the
reference); elsewhere ``with hf_kvspec.decode_kernels(model): ...``.

Why: decoding runs linear layers on 1 row (plain decode, draft forwards) or on a handful of rows (a
speculative verify forward: ``K + 1`` rows per sequence). torch's stock ``F.linear`` on CPU (MKL sgemm) repacks
the weight on every call for few rows, so a verify forward can cost about twice a 1-row forward, which eats the
gain of speculation; a weight packed once ahead is read once per call at any row count. Which kernel wins
depends on the CPU, the shape and the row count, so nothing is hard-coded: the first call of a shape in a row
bucket calibrates it (``trials.py``; or a plan file remembers the choice). Per-shape figures on the machine this project benchmarks on: docs/speculative.md,
"Decode kernels (CPU)".

Eligible: exactly ``nn.Linear`` (not subclasses such as quantized linears), fp32 weight on CPU, no instance-level
``forward`` (e.g. accelerate hooks, which may move the weight per call). Per call, stock
runs when autograd is needed, under CPU autocast, while ``torch.compile`` traces, for other dtypes or devices, and
above ``max_rows`` rows. A call is recognised by its weight (the ``Parameter`` object the layer passes to
``F.linear``), so a weight swapped for another ``Parameter`` while a context is open runs stock.

Memory: each copy is the size of its weight. While a bucket is calibrated (``trials.calibrate``: once per process,
model, shape and row bucket) the layers of that shape hold a copy per candidate kernel; afterwards only the kernels
some bucket of the shape chose stay (so at most two copies of a layer: e.g. a transposed one for 1 row and a
oneDNN one for several; about one model's size for a typical decoder). A context never lets the copies of
all models exceed ``memory_fraction`` of the memory available when it opened (plus what copies already held);
past that a layer stays stock, with one warning. ``DecodeKernels.report()`` (and a speculative output's
``acceptance.kernels``) gives the bytes held, the calibration time and the kernel chosen per shape and row bucket. Reproducibility: which
kernel wins is timed on this machine, so fp32 rounding (and, in near ties, a greedy token) can differ between
machines or runs; ``force=`` or ``decode_kernels=False`` pins the kernel.

Shapes: ``R`` rows (all leading dims flattened), ``I`` in features, ``O`` out features.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hf_kvspec.kernels import copies, trials
from hf_kvspec.kernels.ops import KERNELS, available_kernels, make_copy, onednn_available, run
from hf_kvspec.kernels.trials import BUCKETS, bucket_of, group_label, kernels_in_use, plans, shape_key

__all__ = ["KERNELS", "DecodeKernels", "decode_kernels", "onednn_available", "plans", "release_decode_kernels"]

#: layers with fewer weight elements stay stock unless ``min_weight_elements`` says otherwise: their calls take
#: microseconds, about what the routing's own Python costs
MIN_WEIGHT_ELEMENTS = 1 << 16
_OPEN = threading.local()  # .stack: this thread's open contexts, innermost last


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
        min_weight_elements: smaller layers stay stock (default ``MIN_WEIGHT_ELEMENTS``).
        route_on_enter: True routes every ``F.linear`` call while the context is open; False only those inside
            ``with context.routing():`` blocks (the speculative loop routes its verify forwards only: elsewhere a
            routed call saves less than the routing's own per-call Python costs).
        plans_file: a JSON file of kernel choices (``trials.load_plans``): buckets found there are not
            calibrated again, and new choices are added to it when the context closes. None: this process only.

    Contexts may be nested, overlap on the same model (the innermost open one that holds a layer decides), close
    out of order, and an instance may be re-entered; routing is per thread and stops when no open context (or
    ``routing()`` block) asks for it.
    """

    def __init__(self, *models: nn.Module, max_rows: int = 64, memory_fraction: float = 0.25,
                 force: str | None = None, min_weight_elements: int | None = None, route_on_enter: bool = True,
                 plans_file: str | Path | None = None):
        _require_models(models)
        min_weight_elements = MIN_WEIGHT_ELEMENTS if min_weight_elements is None else min_weight_elements
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
        self.route_on_enter = route_on_enter
        self.plans_file = plans_file
        self._stored: dict[str, str] = {}  # the plan file's choices, read when the context opens
        self._new: dict[str, str] = {}  # choices calibrated by this context, for the plan file
        self._calibrated: set[tuple] = set()  # shape keys this context calibrated (their spare copies go on exit)
        self.modules: list[nn.Linear] = []
        self.by_weight: dict[int, nn.Linear] = {}  # id(weight Parameter) -> its eligible layer
        self.resolved: dict[tuple[int, int], _Settled] = {}  # (id(module), rows) -> settled kernel
        self.groups: dict[int, str] = {}  # id(module) -> label of the model it was reached from
        self.allocated = 0  # bytes of weight copies this context made
        self.calls = dict.fromkeys(KERNELS, 0)  # linear calls per kernel this context routed
        self.calibration_s = 0.0  # seconds this context spent calibrating buckets (trials.calibrate)
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
                if _eligible(module, self.min_weight_elements) and id(module.weight) not in self.by_weight:
                    copies.verify(module)
                    self.modules.append(module)
                    self.by_weight[id(module.weight)] = module
                    self.groups[id(module)] = group_label(model)
                elif isinstance(module, nn.Linear) and not _eligible(module, self.min_weight_elements):
                    copies.release(module)  # e.g. moved to another device or dtype since its copies were made
        self._stored = trials.load_plans(self.plans_file) if self.plans_file is not None else {}
        _open(self)
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        _close(self)
        for key in self._calibrated:
            copies.prune(key, kernels_in_use(key))  # calibration's copies of kernels no bucket chose
        self._save_plans()
        self._calibrated = set()
        self.modules, self.resolved, self.groups, self.by_weight = [], {}, {}, {}

    @contextlib.contextmanager
    def routing(self):
        """Route this thread's ``F.linear`` calls through the open contexts inside the block (for contexts made
        with ``route_on_enter=False``; a no-op when routing is already on)."""
        if self._depth == 0:
            raise RuntimeError("DecodeKernels.routing() needs the context open: `with kernels: ... with "
                               "kernels.routing(): ...`")
        started = _start_routing()
        try:
            yield self
        finally:
            if started:
                _stop_routing()

    def report(self) -> dict:
        """What the kernels hold and chose: ``bytes_held`` (all weight copies of all models), ``bytes_allocated``
        (copies this context made), ``calls`` per kernel, ``calibration_s`` (time this context spent timing
        kernels) and ``plans`` (kernel per model, shape and row bucket)."""
        return {"bytes_held": copies.held_bytes(), "bytes_allocated": self.allocated, "calls": dict(self.calls),
                "calibration_s": self.calibration_s, "plans": plans()}

    def serves(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear | None:
        """The layer whose ``F.linear`` call this is, when it is one of this context's layers."""
        module = self.by_weight.get(id(weight))
        return module if module is not None and module.weight is weight and module.bias is bias else None

    def route(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` for ``x`` [..., I] -> [..., O] through the chosen kernel (stock included)."""
        weight, bias = module.weight, module.bias
        if _needs_stock(weight, bias, x):
            return F.linear(x, weight, bias)
        rows = x.numel() // weight.shape[1]
        settled = _resolved(self, module, weight, rows) or self.settle(module, rows)
        self.calls[settled.kernel] += 1
        if settled.kernel == "stock":
            return F.linear(x, weight, bias)
        flat = x.reshape(rows, weight.shape[1]).contiguous()  # [R, I]
        return run(settled.kernel, flat, settled.copy, bias, weight).reshape(*x.shape[:-1], weight.shape[0])

    # ------------------------------------------------------------------------------ choosing
    def settle(self, module: nn.Linear, rows: int) -> _Settled:
        """The kernel and copy for ``module``'s calls of ``rows`` rows (calibrating the bucket on its first call);
        later calls with as many rows find it in ``resolved``."""
        bucket = bucket_of(rows) if rows <= self.max_rows else None
        key = shape_key(module, self.groups.get(id(module), ""))
        if bucket is None:
            kernel = "stock"
        elif self.force is not None:
            kernel = self.force
        else:
            kernel = trials.chosen(key, bucket) or self._calibrate(key, bucket)
        copy = None if kernel == "stock" else self._copy(module, kernel, key)
        if copy is None:  # stock, or no room for the copy: this layer runs stock
            kernel = "stock"
        settled = _Settled(kernel, copy, copies.WeightStamp.of(module.weight), torch.get_num_threads())
        self.resolved[id(module), rows] = settled
        return settled

    def calibrate(self, max_rows: int | None = None) -> float:
        """Settle every row bucket up to ``max_rows`` (default the context's) for every layer shape now, instead of
        on first use (the plan file first: nothing is timed for what it holds); returns the seconds spent timing.
        For programs that time their own runs (the CLI's ``--compare-plain``, a server at start-up)."""
        if self._depth == 0:
            raise RuntimeError("DecodeKernels.calibrate() needs the context open: `with kernels: kernels.calibrate()`")
        before = self.calibration_s
        limit = self.max_rows if max_rows is None else min(max_rows, self.max_rows)
        shapes = {shape_key(m, self.groups[id(m)]): m for m in self.modules}
        with torch.no_grad():
            for module in shapes.values():
                for low, _ in BUCKETS:
                    if low <= limit:
                        self.settle(module, low)
        return self.calibration_s - before

    def _calibrate(self, key: tuple, bucket: int) -> str:
        """The plan file's choice for this bucket, or time the kernels on every layer of shape ``key``
        (``trials.calibrate``). Copies of the kernels no bucket chose are dropped when the context closes (a
        later bucket's calibration reuses them meanwhile)."""
        layers = [m for m in self.modules if shape_key(m, self.groups[id(m)]) == key]
        stored = self._stored.get(trials.disk_key(key, len(layers), bucket))
        if stored in available_kernels():
            trials.PLANS.setdefault(key, {})[bucket] = stored
            return stored
        start = time.perf_counter()
        with torch.no_grad():
            kernel = trials.calibrate(
                key, bucket, layers, available_kernels(),
                copy_for=lambda module, k: self._copy(module, k, key) is not None,
                run=lambda k, x, module: run(k, x, copies.get(module, k, key), module.bias, module.weight))
        self.calibration_s += time.perf_counter() - start
        self._calibrated.add(key)
        self._new[trials.disk_key(key, len(layers), bucket)] = kernel
        return kernel

    def _save_plans(self) -> None:
        if self.plans_file is None or not self._new:
            return
        trials.save_plans(self.plans_file, {**trials.load_plans(self.plans_file), **self._new})  # warns on failure
        self._new = {}

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


def default_plans_file() -> Path:
    """Where ``speculative_generate`` keeps kernel choices: ``decode_kernel_plans.json`` in the package's cache
    directory (``HF_KVSPEC_CACHE``, default ``~/.cache/hf_kvspec``), beside the converted bundled model."""
    from hf_kvspec.models import cache_dir

    return cache_dir() / "decode_kernel_plans.json"


def decode_kernels(*models: nn.Module, **kwargs) -> DecodeKernels:
    """Shorthand for ``DecodeKernels(*models, **kwargs)``: ``with hf_kvspec.decode_kernels(model): ...``."""
    return DecodeKernels(*models, **kwargs)


def release_decode_kernels(*models: nn.Module) -> int:
    """Free the weight copies kept for these models' linear layers; returns the bytes freed."""
    _require_models(models, "release_decode_kernels")
    return sum(copies.release(module) for model in models for module in model.modules())


def _require_models(models: tuple, name: str = "decode_kernels") -> None:
    bad = [type(model).__name__ for model in models if not isinstance(model, nn.Module)]
    if not models or bad:
        raise TypeError(f"{name} needs loaded models (torch.nn.Module), got {bad or 'none'}; pass the models "
                        "themselves (target, draft), not their configs.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------ routing
_LINEAR = F.linear


class _Router(TorchFunctionMode):
    """One per thread while routing is on there: sends each ``F.linear`` call to the innermost open context
    that holds its layer; every other torch function, and a linear call no context holds, runs unchanged. Inside
    the handler this mode is off, so the kernels' own torch calls (and stock ``F.linear``) run plain."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _LINEAR:
            x, weight, bias = _linear_arguments(args, kwargs)
            for context in reversed(_OPEN.stack):
                module = context.serves(weight, bias)
                if module is not None:
                    return context.route(module, x)
        return func(*args, **kwargs)


def _linear_arguments(args: tuple, kwargs: dict) -> tuple:
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return x, weight, bias


def _open(context: DecodeKernels) -> None:
    """Put ``context`` innermost on this thread; the first one that routes on enter starts the thread's router."""
    if not hasattr(_OPEN, "stack"):
        _OPEN.stack, _OPEN.router, _OPEN.routing_contexts = [], None, 0
    _OPEN.stack.append(context)
    if context.route_on_enter:
        _OPEN.routing_contexts += 1
        _start_routing()


def _close(context: DecodeKernels) -> None:
    """Take ``context`` off this thread's stack (wherever it is: contexts may close out of order); the router stops
    when no open context routes on enter (a ``routing()`` block in progress keeps its own)."""
    stack = getattr(_OPEN, "stack", [])
    if context not in stack:
        return
    stack.remove(context)
    if context.route_on_enter:
        _OPEN.routing_contexts -= 1
        if _OPEN.routing_contexts == 0:
            _stop_routing()


def _start_routing() -> bool:
    """Enter this thread's router unless it is on; True when this call entered it."""
    if _OPEN.router is not None:
        return False
    _OPEN.router = _Router()
    _OPEN.router.__enter__()
    return True


def _stop_routing() -> None:
    router, _OPEN.router = _OPEN.router, None
    if router is not None:
        router.__exit__(None, None, None)


def _eligible(module: nn.Module, min_elements: int) -> bool:
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and module.weight.dim() == 2
            and module.weight.numel() >= min_elements
            and "forward" not in vars(module))  # e.g. accelerate's offload hooks move weights per call: keep stock


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
