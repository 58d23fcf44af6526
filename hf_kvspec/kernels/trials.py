"""Choosing a kernel per weight shape and row bucket by timing real calls.

Boundary: process-wide bookkeeping (``PLANS``), no tensors. Which kernel wins depends on the CPU, the BLAS
build, the thread count, the shape, the row count and whether the weight is in cache, so nothing is
hard-coded: the first real calls of a shape in a row bucket rotate through the kernels (each call still
computes the layer) and report their time; after ``SAMPLES`` calls per kernel the lowest median wins if it
beats stock's median by ``MARGIN`` (stock otherwise: no copy). Only the first ``PROBES`` modules of a shape are
timed, each rotating through every kernel, stock included, so the kernels are compared on the same layers
(a layer that is hot in cache must not race a cold one); the other layers run stock meanwhile and only
the probes get copies before the choice. Trials are per model (``group_label``): a small draft model whose
weights stay in cache is timed apart from its target. A model's layers share shapes (30 layers of SmolLM2 give
30 calls per shape per forward), so a choice settles within a few forwards.
"""

from __future__ import annotations

import itertools
import statistics
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

#: row buckets (low, high): a shape's kernel is chosen per bucket; more rows than the last high run stock
BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 64))
#: a non-stock kernel's median must be at most this fraction of stock's (copies cost memory)
MARGIN = 0.9
SAMPLES = 8  # timed real calls per kernel before a bucket's choice is made
PROBES = 4  # modules per shape and bucket that try non-stock kernels while it is timed


@dataclass
class Trial:
    """Timings of the kernels on real calls of one shape in one row bucket, until one is chosen."""

    candidates: tuple[str, ...]
    key: tuple = ()  # the shape key this trial decides for (see ``shape_key``)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    chosen: str | None = None
    probes: dict[int, int] = field(default_factory=dict)  # id() of a timed module -> its next turn (offset + calls)

    def next_kernel(self, module: object) -> str | None:
        """The kernel ``module``'s next call should time, or None when ``module`` is not one of the probes (it
        runs stock, untimed). Each probe cycles through every candidate, starting at its own offset, so every
        kernel is timed on every probe layer."""
        if id(module) not in self.probes:
            if len(self.probes) >= PROBES:
                return None
            self.probes[id(module)] = len(self.probes)  # offset: probes start on different kernels
        turn = self.probes[id(module)]
        self.probes[id(module)] = turn + 1
        return self.candidates[turn % len(self.candidates)]

    def record(self, kernel: str, seconds: float) -> bool:
        """Add one timing; True when this completed the trial (``chosen`` is now set)."""
        self.seconds.setdefault(kernel, []).append(seconds)
        return self._maybe_choose()

    def drop(self, kernel: str) -> bool:
        """Stop considering ``kernel`` (e.g. no memory for its copies); True when that completed the trial."""
        self.candidates = tuple(k for k in self.candidates if k != kernel)
        self.seconds.pop(kernel, None)
        return self._maybe_choose()

    def _maybe_choose(self) -> bool:
        if self.chosen is not None or any(len(self.seconds.get(k, ())) < SAMPLES for k in self.candidates):
            return False
        median = {kernel: statistics.median(times) for kernel, times in self.seconds.items()}
        best = min(median, key=median.get, default="stock")
        self.chosen = best if best != "stock" and median[best] <= MARGIN * median["stock"] else "stock"
        return True


PLANS: dict[tuple, dict[int, Trial]] = {}  # shape key -> {bucket index: trial}


_LABELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its label
_COUNTER = itertools.count()


def group_label(model: nn.Module) -> str:
    """Names the model a module was reached from: trials are kept per model, and forgotten with it (a new
    model that gets a dead one's ``id`` starts afresh)."""
    label = _LABELS.get(model)
    if label is None:
        label = _LABELS[model] = f"{type(model).__name__}#{next(_COUNTER)}"
        weakref.finalize(model, _forget, label)
    return label


def _forget(label: str) -> None:
    for key in [key for key in PLANS if key[0] == label]:
        del PLANS[key]


def shape_key(module: nn.Linear, group: str = "") -> tuple:
    """(model, O, I, has bias, torch threads): calls with equal keys time alike."""
    out, inp = module.weight.shape
    return group, out, inp, module.bias is not None, torch.get_num_threads()


def bucket_of(rows: int) -> int | None:
    for index, (low, high) in enumerate(BUCKETS):
        if low <= rows <= high:
            return index
    return None


def trial_for(key: tuple, bucket: int, candidates: tuple[str, ...]) -> Trial:
    trials = PLANS.setdefault(key, {})
    if bucket not in trials:
        trials[bucket] = Trial(candidates, key)
    return trials[bucket]


def kernels_in_use(key: tuple) -> set[str]:
    """Kernels some bucket of this shape chose or may still choose (their copies are worth keeping)."""
    used = set()
    for trial in PLANS.get(key, {}).values():
        used |= {trial.chosen} if trial.chosen else set(trial.candidates)
    return used


def plans() -> dict[str, dict[str, dict[str, str]]]:
    """The kernel per model, shape and row bucket so far, e.g.
    ``{"LlamaForCausalLM#0": {"49152x576@1t": {"1": "transposed", "2-4": "timing"}}}``
    (shape ``OxI``, ``+bias`` when it has one, torch threads)."""
    result: dict[str, dict[str, dict[str, str]]] = {}
    for (group, out, inp, bias, threads), trials in PLANS.items():
        shape = f"{out}x{inp}" + ("+bias" if bias else "") + f"@{threads}t"
        result.setdefault(group, {})[shape] = {_bucket_name(index): trial.chosen or "timing"
                                               for index, trial in sorted(trials.items())}
    return result


def _bucket_name(index: int) -> str:
    low, high = BUCKETS[index]
    return str(low) if low == high else f"{low}-{high}"
