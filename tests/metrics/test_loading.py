"""The metric modules load from the installed package with no network, carry a full MetricInfo, and gather across
processes the way ``evaluate`` metrics do."""

from __future__ import annotations

import multiprocessing
import socket

import evaluate
import pytest

import hf_kvspec
from hf_kvspec.metrics import METRIC_NAMES, metric_path


@pytest.fixture
def no_network(monkeypatch):
    """Offline the way a user sets it, and any socket connection an error (so a Hub call cannot pass unnoticed)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise OSError("network access attempted while loading a local metric")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("name", METRIC_NAMES)
def test_loads_offline_through_the_helper_and_evaluate_load(name, no_network, tmp_path):
    metric = hf_kvspec.load_metric(name, cache_dir=str(tmp_path))
    same = evaluate.load(str(metric_path(name)), cache_dir=str(tmp_path))
    assert type(metric).__name__ == type(same).__name__ and metric.name == same.name == name
    info = metric.info
    assert info.description and "@" in info.citation and "Returns" in info.inputs_description
    assert set(info.features) == ({"predictions", "references"} if name == "draft_acceptance" else
                                  {"logprob", "reference_logprob", "kl", "top1_match"})


def test_unknown_metric_names_the_choices():
    with pytest.raises(ValueError, match="draft_acceptance, cache_fidelity"):
        hf_kvspec.load_metric("bleu")


_SHARDS = [  # two processes' responses: (predictions [K][n], references [n])
    [([[2, 3, 9, -1], [3, 8, -1, -1]], [1, 2, 3, 4])],
    [([[5, 6, 7, 8, -1], [6, 7, 0, -1, -1]], [4, 5, 6, 7, 8]), ([[1, -1], [-1, -1]], [0, 1])],
]


def _process(rank: int, cache_dir: str, results) -> None:
    metric = hf_kvspec.load_metric("draft_acceptance", num_process=2, process_id=rank, experiment_id="shards",
                                   cache_dir=cache_dir)
    for predictions, references in _SHARDS[rank]:
        metric.add(predictions=predictions, references=references)
    results.put((rank, metric.compute()))


def test_two_processes_gather_on_process_zero(tmp_path):
    """``num_process``/``process_id``: each process writes its shard; process 0 computes over both, the others get
    None, exactly like one process that saw everything."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_process, args=(rank, str(tmp_path), results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    found = dict(results.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    single = hf_kvspec.load_metric("draft_acceptance", keep_in_memory=True).compute(
        predictions=[p for shard in _SHARDS for p, _ in shard], references=[r for shard in _SHARDS for _, r in shard])
    assert found[1] is None and found[0] == single
    assert single["emitted_tokens"] == 11 and single["positions"] == [8, 5]
