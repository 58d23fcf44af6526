"""``scripts/benchmark.py longctx`` in miniature (tiny model, 64-token context, seconds): the column timer counts what
``generate`` streams, every method reproduces plain greedy, and each row's e2e, ratios, bytes and bounds follow
their definitions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import hf_kvspec
from hf_kvspec.memory import kv_cache_bytes, quantized_view_bytes, sparse_view_bytes
from hf_kvspec.speculative.drafters.view_costs import model_weight_bytes
from tests.tiny_models import tiny_model

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    from bench import longctx

    return longctx


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", hidden_size=256)  # head_dim 64: KIVI's default group size divides it (quantized)


def _args(bench, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def _prompt(batch: int, length: int = 64) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(batch))  # [B, P]


def test_timer_counts_fake_puts(bench):
    one = bench.ColumnTimer(batch=1)
    for value in (torch.zeros(1, 5), torch.tensor([7]), torch.tensor([7, 8, 9]), torch.tensor([4, 5])):
        one.put(value)  # the prompt (2-D, ignored), then 1, 3 and 2 tokens in one put each (speculative rounds)
    assert len(one.times) == 6 and one.times[1] == one.times[3] and one.times[4] == one.times[5]
    two = bench.ColumnTimer(batch=2)
    for value in (torch.zeros(2, 5), torch.tensor([1, 2]), torch.tensor([3, 4])):
        two.put(value)  # one column [B] per put: every row has it
    assert len(two.times) == 2 and two.time_to(2, 0.0) == two.times[1]


@pytest.mark.parametrize("batch", [1, 2])
def test_timer_counts_plain_and_speculative_generate(bench, model, batch):
    ids = _prompt(batch)
    sequences, timer, start, _ = bench._generate(model, ids, DynamicCache(config=model.config), None, 6)
    assert sequences.shape == (batch, 64 + 6) and len(timer.times) == 6
    assert start <= timer.times[0] and timer.times == sorted(timer.times)
    assistant = hf_kvspec.SparseKVAssistant(view="streaming", sink_tokens=4, window=16, num_draft_tokens=4)
    spec, timer, _, out = bench._generate(model, ids, DynamicCache(config=model.config), assistant, 8)
    assert len(timer.times) == 8 and torch.equal(spec[:, :70], sequences)
    if batch == 1:  # one put per round (several tokens); at batch > 1 one put per completed column
        assert len(set(timer.times)) <= out.acceptance.rounds + 1  # the prefill's token, then one stamp per round


def test_bad_options_are_refused(bench):
    with pytest.raises(SystemExit, match="--methods"):
        bench.make_report(_args(bench, ["--methods", "plain,dense"]))
    with pytest.raises(SystemExit, match="new-tokens"):
        bench.make_report(_args(bench, ["--new-tokens", "1,8"]))


@pytest.mark.parametrize("batch", [1, 2])
def test_cell_rows_follow_their_definitions(bench, model, batch, tmp_path):
    args = _args(bench, ["--new-tokens", "3,8", "--window", "16", "--max-load", "99", "--validate-e2e",
                         "--results-name", "longctx.test"])
    report = bench.make_report(args)
    rows = bench._measure(model, _prompt(batch), args, report)
    assert [r["method"] for r in rows] == ["plain", "streaming", "quantized", "auto", "auto (own prefill)"]
    by_method = {r["method"]: r for r in rows}
    plain = by_method["plain"]
    weights = model_weight_bytes(model) / bench.MB
    for row in rows:
        assert 0 < row["e2e_3_s"] < row["e2e_8_s"] and " -> " in row["load"]
        assert row["ratio_e2e_8"] == pytest.approx(plain["e2e_8_s"] / row["e2e_8_s"])
        assert row["ratio_decode"] == pytest.approx(plain["tpot_ms"] / row["tpot_ms"])
    for method in ("plain", "streaming", "quantized", "auto"):
        row = by_method[method]
        assert row["same_as_plain"] is True, method  # greedy: every method is token-identical to plain
        assert row["weights_mb"] == pytest.approx(weights) and row["prefill_s"] == plain["prefill_s"] > 0
        assert row["target_kv_mb"] * bench.MB == kv_cache_bytes(model.config, 64, batch, torch.float32)
    for method in ("streaming", "quantized", "auto"):
        row = by_method[method]
        view = (quantized_view_bytes(model.config, 64, batch, torch.float32, sink_tokens=4) if method == "quantized"
                else sparse_view_bytes(model.config, batch, 4, 16, args.k, torch.float32))
        assert row["draft_kv_mb"] * bench.MB == view
        c_d_bytes = (weights + row["draft_kv_mb"]) / (weights + 3 * row["target_kv_mb"])
        assert row["bound_bytes"] == pytest.approx(row["tau"] / (1 + row["mean_k"] * c_d_bytes))
        assert row["bound"] == pytest.approx(row["tau"] / (row["c_v"] + row["mean_k"] * row["c_d"]))
        assert row["tau"] >= 1
    assert len(by_method["streaming"]["acceptance"]) == args.k  # one rate per draft position
    path = report.write(tmp_path)
    assert path.name == "longctx.test.md" and "| context | batch | method | prefill_s | tpot_ms |" in path.read_text()
    assert len(json.loads(path.with_suffix(".json").read_text())["rows"]) == 5
