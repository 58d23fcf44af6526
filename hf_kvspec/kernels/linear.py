"""Decode kernels: ``nn.Linear`` calls with few rows, on CPU, through the fastest of three measured kernels.

Boundary: the only module that touches torch's private oneDNN ops (``torch.ops.mkldnn._reorder_linear_weight``
and ``_linear_pointwise``, the kernels ``torch.compile``'s CPU backend emits for frozen linear layers). It
swaps the ``forward`` of eligible ``nn.Linear`` instances while a ``DecodeKernels`` context is open and puts
them back on exit; weights, state dicts and every other module are untouched.

Why: decoding runs linear layers on 1 row (plain decode, draft forwards) or on a handful of rows (a
speculative verify forward: ``K + 1`` rows per sequence). On CPUs where torch's stock ``F.linear`` (MKL sgemm)
is slow for 2-16 rows, a verify forward costs about twice a 1-row forward, which eats the gain of
speculation. Measured on the 2-core AMD EPYC (Zen 3) this project benchmarks on, one thread, fp32:

    shape (out x in)   rows   stock    oneDNN prepacked   transposed copy
    1536 x 576           5    356 us   239 us              364 us
    576 x 1536           5    297 us   225 us              296 us
    49152 x 576 (head)   1    8.2 ms   7.3 ms              4.2 ms
    49152 x 576 (head)   5   20.9 ms   9.4 ms             27.7 ms

Which kernel wins depends on the CPU, the BLAS build, the thread count, the shape, the row count and whether
the weight is in cache, so nothing is hard-coded: the first real calls of a shape in a row bucket rotate through
the kernels (every call still computes the layer) and time themselves; after ``_SAMPLES`` calls per kernel the
one with the lowest median wins if it beats stock's median by ``_MARGIN`` (stock otherwise: no copy, no memory),
and copies no bucket chose are dropped. The choice is then fixed for the process (``plans()`` lists it). A
model's layers share shapes (30 layers of SmolLM2 -> 30 calls per shape per forward), so this settles within
the first forward or two.

Kernels (all compute ``x @ W.T + b`` in fp32; they differ only in summation order, i.e. by rounding):
    stock       ``F.linear(x, W, b)`` - the reference path
    transposed  ``addmm(b, x, W_t)`` with a contiguous copy ``W_t`` [in, out] (public ops; helps 1-row GEMV)
    onednn      oneDNN with the weight reordered once into its blocked layout (helps 2-16 rows)

Eligible: exactly ``nn.Linear`` (not subclasses such as quantized linears), fp32 weight on CPU, no other
instance-level ``forward`` (e.g. accelerate hooks); per call: no autograd needed, input dtype fp32, at most
``max_rows`` rows. Everything else runs stock. Copies are kept per module (weakly, freed with the model) and
re-made when the weight changes (``data_ptr`` or in-place version); ``release_decode_kernels(model)`` frees them now.
Memory: each copy is the size of its weight; a context never allocates more than ``memory_fraction`` of the
memory available when it opened, and warns once when it had to leave a layer stock for that reason.

Shapes: ``R`` rows (all leading dims flattened), ``I`` in features, ``O`` out features.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("stock", "transposed", "onednn")
#: row buckets (low, high, rows timed): a shape's kernel is chosen per bucket
BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 64))  # (low, high) rows
#: a non-stock kernel's median must be at most this fraction of stock's to be chosen (copies cost memory)
_MARGIN = 0.9
_SAMPLES = 8  # timed real calls per kernel before a bucket's choice is made

_PLANS: dict[tuple, dict[int, _Trial]] = {}  # (O, I, has_bias, threads) -> {bucket index: trial}
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Linear -> _Copies
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Linear -> open contexts using it


@dataclass
class _Trial:
    """Timings of the kernels on real calls of one shape in one row bucket, until one is chosen."""

    candidates: tuple[str, ...]
    seconds: dict[str, list[float]] = field(default_factory=dict)
    chosen: str | None = None

    def next_kernel(self) -> str:
        return min(self.candidates, key=lambda kernel: len(self.seconds.get(kernel, ())))

    def record(self, kernel: str, seconds: float) -> bool:
        """Add one timing; True when this completed the trial (``chosen`` is now set)."""
        self.seconds.setdefault(kernel, []).append(seconds)
        if self.chosen is not None or any(len(self.seconds.get(k, ())) < _SAMPLES for k in self.candidates):
            return False
        median = {kernel: statistics.median(times) for kernel, times in self.seconds.items()}
        best = min(median, key=median.get)
        self.chosen = best if best != "stock" and median[best] <= _MARGIN * median["stock"] else "stock"
        return True


@dataclass
class _Copies:
    """The weight copies one module's kernels use, and the weight they were made from."""

    fingerprint: tuple
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ kernels
def onednn_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops and they compute ``F.linear``."""
    return _onednn_self_test()


@functools.cache
def _onednn_self_test() -> bool:
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        weight, x = torch.randn(24, 16), torch.randn(3, 16)
        out = _run("onednn", x, _make_copy("onednn", weight), None)
        return torch.allclose(out, F.linear(x, weight), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _make_copy(kernel: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [O, I] in the layout ``kernel`` reads (None for stock)."""
    weight = weight.detach()
    if kernel == "transposed":
        return weight.t().contiguous()  # [I, O]
    if kernel == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, 8)  # batch-size hint; any row count works
    return None


def _run(kernel: str, x: torch.Tensor, copy: torch.Tensor | None, bias: torch.Tensor | None,
         weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [R, I] -> [R, O] with one kernel; ``copy`` from ``_make_copy``, ``weight`` [O, I] for stock."""
    if kernel == "transposed":
        return torch.mm(x, copy) if bias is None else torch.addmm(bias, x, copy)
    if kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------------------------------------ planning
def plans() -> dict[str, dict[str, str]]:
    """The kernel per shape and row bucket so far, e.g. ``{"49152x576@1t": {"1": "transposed", "2-4": "timing"}}``
    (shape ``OxI``, ``+bias`` when it has one, torch threads)."""
    return {f"{out}x{inp}" + ("+bias" if bias else "") + f"@{threads}t":
            {_bucket_name(index): trial.chosen or "timing" for index, trial in sorted(trials.items())}
            for (out, inp, bias, threads), trials in _PLANS.items()}


def _bucket_name(index: int) -> str:
    low, high = BUCKETS[index]
    return str(low) if low == high else f"{low}-{high}"


def _bucket(rows: int) -> int | None:
    for index, (low, high) in enumerate(BUCKETS):
        if low <= rows <= high:
            return index
    return None


def _shape_key(module: nn.Linear) -> tuple:
    out, inp = module.weight.shape
    return out, inp, module.bias is not None, torch.get_num_threads()


def _kernels_in_use(key: tuple) -> set[str]:
    """Kernels some bucket of this shape chose or is still timing (their copies are worth keeping)."""
    used = set()
    for trial in _PLANS.get(key, {}).values():
        used |= {trial.chosen} if trial.chosen else set(trial.candidates)
    return used


# ------------------------------------------------------------------------------------------------ context
class DecodeKernels:
    """``with DecodeKernels(model, draft): ...`` - small-row fp32 CPU ``nn.Linear`` calls use the fastest kernel.

    Args:
        *models: modules whose ``nn.Linear`` submodules may switch kernels (a target, a draft model).
        max_rows: calls with more rows (prefill) always run stock; at most 64 (the last timed bucket).
        memory_fraction: the most this context may allocate for weight copies, as a fraction of the memory
            available when it opens.
        force: one of ``KERNELS`` for every eligible call instead of timing (tests, reproducibility).

    The context is re-entrant and may be nested or overlap with another on the same model.
    """

    def __init__(self, *models: nn.Module, max_rows: int = 64, memory_fraction: float = 0.25,
                 force: str | None = None):
        if not 1 <= max_rows <= BUCKETS[-1][1]:
            raise ValueError(f"max_rows must be in 1..{BUCKETS[-1][1]}, got {max_rows}")
        if force is not None and force not in KERNELS:
            raise ValueError(f"force must be one of {KERNELS} or None, got {force!r}")
        if force == "onednn" and not onednn_available():
            raise RuntimeError("force='onednn' but this torch build has no working oneDNN linear ops "
                               "(torch.backends.mkldnn); use force='transposed' or leave force=None.")
        self.models, self.max_rows, self.force = models, max_rows, force
        self.memory_fraction = memory_fraction
        self.modules: list[nn.Linear] = []
        self.allocated = 0  # bytes of weight copies this context made
        self.calls = dict.fromkeys(KERNELS, 0)  # linear calls per kernel while this context was innermost
        self._room = 0
        self._warned = False

    def __enter__(self) -> DecodeKernels:
        self._room = int(self.memory_fraction * _available_bytes())
        self.modules = [module for model in self.models for module in model.modules() if _eligible(module)]
        for module in self.modules:
            _install(module, self)
        return self

    def __exit__(self, *exc) -> None:
        for module in self.modules:
            _uninstall(module)
        self.modules = []

    # ------------------------------------------------------------------------------ per call
    def kernel_for(self, module: nn.Linear, rows: int) -> tuple[str, torch.Tensor | None, _Trial | None]:
        """The kernel for a call of ``rows`` rows, its weight copy, and the trial to report the call's time to
        while the bucket is still being timed (``("stock", None, None)`` when no other kernel applies)."""
        bucket = _bucket(rows) if rows <= self.max_rows else None
        trial = None
        if bucket is None:
            kernel = "stock"
        elif self.force is not None:
            kernel = self.force
        else:
            trial = _PLANS.setdefault(_shape_key(module), {}).get(bucket)
            if trial is None:
                trial = _PLANS[_shape_key(module)][bucket] = _Trial(KERNELS if onednn_available() else KERNELS[:2])
            kernel, trial = (trial.chosen, None) if trial.chosen else (trial.next_kernel(), trial)
        copy = None if kernel == "stock" else self._copy(module, kernel)
        if copy is None and kernel != "stock":  # no room for the copy: stock, and stop timing this bucket here
            kernel, trial = "stock", None
        self.calls[kernel] += 1
        return kernel, copy, trial

    def _copy(self, module: nn.Linear, kernel: str) -> torch.Tensor | None:
        weight = module.weight
        fingerprint = (weight.data_ptr(), weight._version, tuple(weight.shape))
        copies = _COPIES.get(module)
        if copies is None or copies.fingerprint != fingerprint:  # new, or the weight changed since
            copies = _COPIES[module] = _Copies(fingerprint)
        if len(copies.tensors) > 1 and self.force is None:  # drop copies of kernels no bucket chose
            used = _kernels_in_use(_shape_key(module))
            for unused in [k for k in copies.tensors if k not in used and k != kernel]:
                del copies.tensors[unused]
        if kernel not in copies.tensors:
            size = weight.numel() * weight.element_size()
            if size > self._room - self.allocated:
                self._warn_memory(size)
                return None
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable outside inference mode
                copies.tensors[kernel] = _make_copy(kernel, weight)
            self.allocated += size
        return copies.tensors[kernel]

    def _warn_memory(self, size: int) -> None:
        if not self._warned:
            warnings.warn(f"DecodeKernels: a {size / 2**20:.0f} MiB weight copy would exceed "
                          f"memory_fraction={self.memory_fraction} of the available memory; that layer keeps "
                          "torch's stock kernel (slower, same results). Raise memory_fraction or free memory.",
                          RuntimeWarning, stacklevel=4)
            self._warned = True


def decode_kernels(*models: nn.Module, **kwargs) -> DecodeKernels:
    """Shorthand for ``DecodeKernels(*models, **kwargs)``: ``with hf_kvspec.decode_kernels(model): ...``."""
    return DecodeKernels(*models, **kwargs)


def release_decode_kernels(*models: nn.Module) -> int:
    """Free the weight copies kept for these models' linear layers; returns the bytes freed."""
    freed = 0
    for model in models:
        for module in model.modules():
            copies = _COPIES.pop(module, None)
            if copies is not None:
                freed += sum(module.weight.numel() * module.weight.element_size() for _ in copies.tensors)
    return freed


# ------------------------------------------------------------------------------------------------ install
def _eligible(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and module.weight.dim() == 2
            and ("forward" not in vars(module) or module in _INSTALLED))


def _install(module: nn.Linear, context: DecodeKernels) -> None:
    stack = _INSTALLED.setdefault(module, [])
    stack.append(context)
    if len(stack) == 1:
        module.forward = functools.partial(_forward, module)


def _uninstall(module: nn.Linear) -> None:
    stack = _INSTALLED.get(module)
    if not stack:
        return
    stack.pop()
    if not stack:
        del _INSTALLED[module]
        vars(module).pop("forward", None)  # the class's forward shows through again


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for ``x`` [..., I] -> [..., O] through the innermost open context's kernel."""
    weight, bias = module.weight, module.bias
    needs_grad = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad
                                              or (bias is not None and bias.requires_grad))
    if needs_grad or x.dtype != weight.dtype or x.device != weight.device or x.shape[-1] != weight.shape[1]:
        return F.linear(x, weight, bias)
    rows = x.numel() // weight.shape[1]
    kernel, copy, trial = _INSTALLED[module][-1].kernel_for(module, rows)
    if trial is None and kernel == "stock":
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, weight.shape[1]).contiguous()  # [R, I]
    start = time.perf_counter()
    out = _run(kernel, flat, copy, bias, weight)  # [R, O]
    if trial is not None:
        trial.record(kernel, time.perf_counter() - start)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _available_bytes() -> int:
    """MemAvailable from /proc/meminfo; elsewhere a large number (no guard)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62
