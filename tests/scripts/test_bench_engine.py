"""``scripts/benchmark.py engine`` end to end on a tiny model in seconds: every system serves every request at
Poisson and all-at-once arrivals, greedy outputs agree across systems (the engine with an assistant too), and the figures are consistent."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import pytest

from tests.serving.helpers import greedy_reference, random_prompts
from tests.tiny_models import tiny_model

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    from bench import engine

    return engine


def args_for(bench, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_arrivals_and_percentiles(bench):
    assert bench.arrival_times(4, None) == [0.0] * 4
    times = bench.arrival_times(2000, 4.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0 and all(g >= 0 for g in gaps)
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.025  # mean gap 1/rate; 2000 exponential gaps: sd of mean ~0.006
    assert bench.percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and bench.percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)
    assert bench.percentile([], 0.5) is None
    assert bench.parse_rates("0.5,all,2") == [0.5, None, 2.0]
    with pytest.raises(ValueError, match="positive rate"):
        bench.parse_rates("0")


def test_every_system_serves_every_request(bench, tmp_path):
    model = tiny_model("llama")
    prompts = random_prompts([5, 17, 9, 30, 3, 12], seed=9)
    args = args_for(bench, ["--rates", "200,all", "--max-new-tokens", "6", "--static-batch-size", "4",
                            "--max-running", "4", "--max-tokens-per-round", "32", "--kv-budget", "64"])
    args.kv_budget = 64  # blocks
    report = bench.run_all(model, prompts, args, eos_ids={2}, pad_id=0)
    assert [(r["rate"], r["system"]) for r in report.rows] == [
        (rate, system) for rate in (200.0, "all") for system in ("hf", "static", "engine")]
    expected_tokens = sum(len(greedy_reference(model, p, 6)) for p in prompts)
    for row in report.rows:
        assert row["completed"] == len(prompts) and row["output_tokens"] == expected_tokens, row
        assert row["same_as_engine"] == len(prompts), row  # greedy: each system reproduces generate()
        assert row["tok_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"], rel=0.01)
        assert 0 <= row["ttft_p50"] <= row["ttft_p99"] and 0 <= row["itl_p50"] <= row["itl_p99"]
    engine_rows = [r for r in report.rows if r["system"] == "engine"]
    assert all(0 < r["block_util"] <= 1 and 0 < r["slot_util"] <= 1 for r in engine_rows)
    assert all(r["vs_hf"] == pytest.approx(r["tok_per_s"] / h["tok_per_s"], rel=0.01)
               for r, h in zip(engine_rows, [r for r in report.rows if r["system"] == "hf"]))
    path = report.write(tmp_path)
    payload = json.loads(path.with_suffix(".json").read_text())
    assert len(payload["rows"]) == 6 and "| rate | system |" in path.read_text()


def test_the_engine_with_an_assistant_serves_every_request_like_generate(bench):
    model = tiny_model("llama")
    prompts = random_prompts([5, 17, 9], seed=9)
    args = args_for(bench, ["--rates", "all", "--max-new-tokens", "6", "--systems", "engine", "--assistant", "ngram",
                            "--max-running", "4", "--max-tokens-per-round", "32", "--kv-budget", "64"])
    args.kv_budget = 64  # blocks
    report = bench.run_all(model, prompts, args, eos_ids={2}, pad_id=0)
    systems = [r["system"] for r in report.rows]
    assert systems == ["engine", "engine+ngram"], systems
    expected_tokens = sum(len(greedy_reference(model, p, 6)) for p in prompts)
    for row in report.rows:
        assert row["completed"] == len(prompts) and row["output_tokens"] == expected_tokens, row
        assert row["same_as_engine"] == len(prompts), row


def test_the_load_sweep_runs_the_suffix_pool_and_the_mixed_drafter(bench):
    """``engine --workload ... --assistant suffix,suffix+ngram`` on a tiny model: every system serves every request
    with the plain engine's output, and the pool's columns are filled."""
    from bench import engine_load

    model = tiny_model("llama")
    prompts = random_prompts([5, 17, 9], seed=9, vocab=12)
    args = args_for(bench, ["--max-new-tokens", "8", "--systems", "engine", "--assistant", "suffix,suffix+ngram",
                            "--max-tokens-per-round", "32", "--kv-budget", "64"])
    args.kv_budget = 64  # blocks
    runs = engine_load.systems(model, None, args, eos_ids={2})
    rows = engine_load.run_cell(runs, "tiny", "C=2", 2, prompts, bench.arrival_times(3, None))
    assert [r["system"] for r in rows] == ["engine", "engine+suffix", "engine+suffix+ngram"]
    for row in rows:
        assert row["completed"] == 3 and row["same_as_engine"] == 3, row
    assert all("pool_kib" in r and "hit_rate" in r for r in rows[1:]) and "by_pool" in rows[2]


def test_the_workloads_are_committed_and_well_formed():
    sys.path.insert(0, str(SCRIPTS))
    from bench import workloads

    root = SCRIPTS.parent
    for name in workloads.WORKLOADS:
        lines = (root / workloads.DIRECTORY / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == workloads.COUNT, name
        assert all(json.loads(line)["messages"][-1]["role"] == "user" for line in lines)
    function = workloads.code_function(__import__("random").Random(0))
    assert len(function.splitlines()) == 40
    compile(function, "<workload>", "exec")  # the code-edit functions are valid Python
    with pytest.raises(ValueError, match="workloads are"):
        workloads.load("poems", 1)
