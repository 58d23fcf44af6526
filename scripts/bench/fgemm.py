"""fp32 few-row GEMM (hf_kvspec/kernels/fp32.py) vs torch's kernels over every linear weight of the bundled model.

    python scripts/benchmark.py fgemm                                  # R = 1, 2, 3, 4, 6, 8, 12, 16, 32
    python scripts/benchmark.py fgemm --rows 1 8 --repeats 15 --name fgemm.quick

Timing: the fast forward's fused linear shapes of SmolLM2-135M, per layer qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536, 30 layers, plus the 49152 x 576 LM head (134M weights; random weights of those
shapes: values do not change the work), at R activation rows; one pass over all of them per sample, kernels
interleaved within each repeat (each repeat sees the same machine load), min over repeats of wall time and of thread
CPU time. Kernels: ``mm`` = ``torch.mm(x, W_t)`` on a transposed contiguous copy (the fast forward's 1-row path),
``F.linear`` (stock, no copy), ``onednn`` = ``hf_kvspec.kernels.ops.run("onednn", ...)`` on ``make_copy("onednn",
W)`` (its several-row path), ``fgemm`` = ``fp32_linear`` on ``pack_fp32(W)``. ``vs_mm1`` divides by ``mm`` at
R = 1 (the decode step's cost today). Results: benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from bench.harness import Report, load_averages
from hf_kvspec.kernels.fp32 import fp32_linear, pack_fp32
from hf_kvspec.kernels.ops import make_copy, onednn_available
from hf_kvspec.kernels.ops import run as run_kernel

# (O, I) of one fused SmolLM2-135M decoder layer: qkv, o, gate_up, down
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
LM_HEAD = (49152, 576)


def add_arguments(parser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32])
    parser.add_argument("--repeats", type=int, default=9, help="samples per row count and kernel (min is kept)")
    parser.add_argument("--name", default="fgemm", help="results file stem under benchmarks/results")


def _weights(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * 0.05 for shape in LAYER_SHAPES * LAYERS + [LM_HEAD]]


def _passes(weights: list[torch.Tensor]) -> dict:
    """kernel label -> callable(xs) running every weight once (xs: in_features -> x [R, I])."""
    transposed = [w.t().contiguous() for w in weights]  # [I, O]
    packed = [pack_fp32(w) for w in weights]
    passes = {
        "mm": lambda xs: [torch.mm(xs[t.shape[0]], t) for t in transposed],
        "F.linear": lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights],
        "fgemm": lambda xs: [fp32_linear(xs[p.shape[1]], p) for p in packed],
    }
    if onednn_available():
        blocked = [(make_copy("onednn", w), w.shape[1]) for w in weights]
        passes["onednn"] = lambda xs: [run_kernel("onednn", xs[i], c, None) for c, i in blocked]
    return passes


def _time_once(run, xs) -> tuple[float, float]:
    start_wall, start_cpu = time.perf_counter(), time.thread_time()
    run(xs)
    return time.perf_counter() - start_wall, time.thread_time() - start_cpu


def run(args) -> None:
    report = Report(args.name, "fp32 linear kernels over all SmolLM2-135M fused linear weights (1 pass, min of "
                    "interleaved repeats)", ["rows", "kernel", "wall_ms", "cpu_ms", "vs_mm1", "GB_per_s",
                                             "GFLOP_per_s"],
                    settings={"rows": args.rows, "repeats": args.repeats})
    load_before = load_averages()
    weights = _weights()
    nbytes, params = sum(w.nbytes for w in weights), sum(w.numel() for w in weights)
    passes = _passes(weights)
    mm1 = None
    for rows in args.rows:
        xs = {i: torch.randn(rows, i) for i in (576, 1536)}
        best = {label: [float("inf"), float("inf")] for label in passes}
        for run_pass in passes.values():  # warm-up: first-call costs (oneDNN primitives, the kernel's build)
            run_pass(xs)
        for _ in range(args.repeats):
            for label, run_pass in passes.items():
                wall, cpu = _time_once(run_pass, xs)
                best[label] = [min(best[label][0], wall), min(best[label][1], cpu)]
        mm1 = best["mm"][0] if rows == 1 else mm1
        for label, (wall, cpu) in best.items():
            report.add(rows=rows, kernel=label, wall_ms=round(wall * 1e3, 1), cpu_ms=round(cpu * 1e3, 1),
                       vs_mm1=round(wall / mm1, 2) if mm1 else "", GB_per_s=round(nbytes / wall / 1e9, 1),
                       GFLOP_per_s=round(2 * rows * params / wall / 1e9, 1))
    report.notes += [f"Load average (1, 5, 15 min) before: {load_before}; after: {load_averages()}.",
                     f"{torch.get_num_threads()} torch thread(s); {len(weights)} calls per pass, each including its "
                     f"Python call overhead; weights {nbytes / 1e6:.0f} MB fp32.",
                     "vs_mm1: wall time over mm's at R = 1 (the decode step's linear layers today).",
                     "cpu_ms is thread CPU time (time.thread_time): robust to being descheduled, not to memory "
                     "bandwidth taken by other processes."]
    report.write()
