"""Benchmark subcommands for ``scripts/benchmark.py``; each module exposes ``add_arguments`` and ``run``."""
