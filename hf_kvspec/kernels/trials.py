"""Choosing a kernel per weight shape and row bucket by timing sweeps over the model's own layers.

Boundary: process-wide bookkeeping (``PLANS``) and the timing loop; it gets the layers, the weight copies and the
kernels from its caller (``linear.py``) and keeps no tensors.

Which kernel wins depends on the CPU, the BLAS build, the thread count, the shape, the row count and whether the
weight is in cache, so nothing is hard-coded. The first call of a shape in a row bucket calibrates it: every
candidate kernel computes the bucket's largest row count on *all* layers of the shape, one after the other, as a forward
does (the weights are as cold as in a forward: a model's layers do not fit in the CPU's caches together), in
``ROUNDS`` interleaved rounds after one untimed warm-up round; a kernel's time is its fastest round (timer and
scheduler noise only ever adds). The fastest kernel is chosen if it beats stock by ``MARGIN`` (copies cost
memory), stock otherwise. Timing single calls of a few probe layers (an earlier design) was misled by noise on
calls of a few hundred microseconds; a sweep costs ``ROUNDS + 1`` passes over the shape's weights per kernel, once
per process, model, shape and bucket. Plans are per model (``group_label``): a small draft model whose weights
stay in cache is calibrated apart from its target.

A plan file (``load_plans``/``save_plans``, JSON) keeps choices across processes, keyed by what makes timings
alike: CPU model, torch version, threads, shape, bias, how many layers share the shape (a proxy for whether they
stay in cache) and bucket; ``speculative_generate`` keeps one under the package's cache directory, so a machine
calibrates once.
"""

from __future__ import annotations

import itertools
import json
import platform
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

#: row buckets (low, high): a shape's kernel is chosen per bucket; more rows than the last high run stock
BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 64))
#: a non-stock kernel must take at most this fraction of stock's time to be chosen (copies cost memory)
MARGIN = 0.97
ROUNDS = 2  # timed sweeps per kernel (after one warm-up sweep); the fastest counts
MIN_TIMED_CALLS = 8  # a shape with few layers (an LM head) gets more sweeps, so each kernel is timed this often

PLANS: dict[tuple, dict[int, str]] = {}  # shape key -> {bucket index: chosen kernel}
SECONDS: dict[tuple, dict[int, dict[str, float]]] = {}  # shape key -> {bucket: {kernel: fastest sweep seconds}}

_LABELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its label
_COUNTER = itertools.count()

#: ``run(kernel, x [R, I], module) -> [R, O]`` and ``copy_for(module, kernel) -> bool`` (False: no memory for it)
Runner = Callable[[str, torch.Tensor, nn.Linear], torch.Tensor]


def calibrate(key: tuple, bucket: int, layers: Sequence[nn.Linear], candidates: Sequence[str],
              copy_for: Callable[[nn.Linear, str], bool], run: Runner, clock=time.perf_counter) -> str:
    """Time ``candidates`` over ``layers`` (all of one shape) at the bucket's largest row count (where a kernel
    that repacks per call loses most; measured on the bundled model, the winner there also wins below it),
    record and return the choice."""
    usable = ["stock"] + [k for k in candidates if k != "stock" and all(copy_for(m, k) for m in layers)]
    x = torch.randn(BUCKETS[bucket][1], layers[0].weight.shape[1], dtype=layers[0].weight.dtype)  # [R, I]
    best = _sweeps(usable, layers, x, run, clock)
    chosen = pick(best)
    PLANS.setdefault(key, {})[bucket] = chosen
    SECONDS.setdefault(key, {})[bucket] = best
    return chosen


def _sweeps(kernels: Sequence[str], layers: Sequence[nn.Linear], x: torch.Tensor, run: Runner, clock) -> dict:
    """{kernel: fastest of the timed sweeps over ``layers`` on input ``x`` [R, I]}, after a warm-up sweep:
    ``ROUNDS`` sweeps, or enough that every kernel is timed on ``MIN_TIMED_CALLS`` calls."""
    best = dict.fromkeys(kernels, float("inf"))
    for sweep in range(max(ROUNDS, -(-MIN_TIMED_CALLS // len(layers))) + 1):
        for kernel in kernels if sweep % 2 else reversed(kernels):  # alternate the order: no kernel always first
            start = clock()
            for module in layers:
                run(kernel, x, module)
            if sweep > 0:
                best[kernel] = min(best[kernel], clock() - start)
    return best


def pick(seconds: dict[str, float]) -> str:
    """The fastest kernel if it beats stock's time by ``MARGIN``, else stock."""
    fastest = min(seconds, key=seconds.get)
    return fastest if fastest != "stock" and seconds[fastest] <= MARGIN * seconds["stock"] else "stock"


def group_label(model: nn.Module) -> str:
    """Names the model a module was reached from: plans are kept per model, and forgotten with it (a new
    model that gets a dead one's ``id`` starts afresh)."""
    label = _LABELS.get(model)
    if label is None:
        label = _LABELS[model] = f"{type(model).__name__}#{next(_COUNTER)}"
        weakref.finalize(model, _forget, label)
    return label


def _forget(label: str) -> None:
    """Drops a collected model's plans; runs from its finalizer, so at any allocation of any thread's code."""
    for table in (PLANS, SECONDS):
        for key in [key for key in table.copy() if key[0] == label]:
            table.pop(key, None)


def shape_key(module: nn.Linear, group: str = "") -> tuple:
    """(model, O, I, has bias, torch threads): calls with equal keys time alike."""
    out, inp = module.weight.shape
    return group, out, inp, module.bias is not None, torch.get_num_threads()


def bucket_of(rows: int) -> int | None:
    for index, (low, high) in enumerate(BUCKETS):
        if low <= rows <= high:
            return index
    return None


def chosen(key: tuple, bucket: int) -> str | None:
    return PLANS.get(key, {}).get(bucket)


def kernels_in_use(key: tuple) -> set[str]:
    """Kernels some bucket of this shape chose (their copies are worth keeping)."""
    return set(PLANS.get(key, {}).values())


def plans() -> dict[str, dict[str, dict[str, str]]]:
    """The kernel per model, shape and row bucket so far, e.g.
    ``{"LlamaForCausalLM#0": {"49152x576@1t": {"1": "transposed", "2-4": "onednn"}}}``
    (shape ``OxI``, ``+bias`` when it has one, torch threads)."""
    result: dict[str, dict[str, dict[str, str]]] = {}
    # a copy: a model collected mid-loop runs ``_forget`` (its finalizer) and would resize ``PLANS`` under the loop
    for (group, out, inp, bias, threads), buckets in PLANS.copy().items():
        shape = f"{out}x{inp}" + ("+bias" if bias else "") + f"@{threads}t"
        result.setdefault(group, {})[shape] = {bucket_name(index): kernel for index, kernel in sorted(buckets.items())}
    return result


def bucket_name(index: int) -> str:
    low, high = BUCKETS[index]
    return str(low) if low == high else f"{low}-{high}"


# ---------------------------------------------------------------------------------------------- plan files
def disk_key(key: tuple, layers: int, bucket: int) -> str:
    """The plan file's key of an in-process ``(shape key, bucket)`` whose shape ``layers`` layers share."""
    _, out, inp, bias, threads = key
    return (f"{_cpu_name()}|torch {torch.__version__}|{threads}t|{out}x{inp}{'+bias' if bias else ''}"
            f"|{layers} layers|rows {bucket_name(bucket)}")


KERNEL_NAMES = ("stock", "transposed", "onednn")  # what a plan file may choose
_WARNED: set[tuple[str, str]] = set()  # (file, what) already warned about in this process


def load_plans(path: str | Path) -> dict[str, str]:
    """The choices stored in ``path``: empty when it is missing; when it is unreadable or ill-typed (not JSON, not
    ``{"plans": {key: kernel}}``), empty too, with one warning naming the file. Either way the buckets without a
    choice calibrate, and the next save rewrites the file whole."""
    path = Path(path)
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:  # a directory, no permission, not UTF-8, not JSON
        _warn_once(path, "read", f"ignoring it ({type(err).__name__}: {err}); the kernels are calibrated again")
        return {}
    plans = stored.get("plans") if isinstance(stored, dict) else None
    if not isinstance(plans, dict):
        _warn_once(path, "read", 'ignoring it: not a {"plans": {key: kernel}} object; the kernels are calibrated '
                                 "again")
        return {}
    good = {k: v for k, v in plans.items() if isinstance(k, str) and v in KERNEL_NAMES}
    if len(good) < len(plans):
        _warn_once(path, "read", f"ignoring {len(plans) - len(good)} entr(ies) that name no kernel of "
                                 f"{KERNEL_NAMES}; those buckets are calibrated again")
    return good


def save_plans(path: str | Path, plans: dict[str, str]) -> bool:
    """Write ``plans`` to ``path`` atomically (a reader never sees half a file). A path that cannot be written (a
    read-only cache directory) gets one warning per process and False: the plans stay in memory (``PLANS``)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"format": "hf_kvspec decode kernel plans v1", "plans": plans}, indent=1,
                                      sort_keys=True))
        partial.replace(path)
    except OSError as err:
        _warn_once(path, "write", f"could not store kernel plans there ({err}); they are kept in memory for this "
                                  "process. Point HF_KVSPEC_CACHE at a writable directory to keep them across runs")
        return False
    return True


def _warn_once(path: Path, what: str, message: str) -> None:
    if (str(path), what) not in _WARNED:
        _WARNED.add((str(path), what))
        warnings.warn(f"DecodeKernels: kernel plan file {path}: {message}.", RuntimeWarning, stacklevel=4)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
