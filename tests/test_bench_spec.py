"""The pure parts of the tree benchmark (scripts/bench/spec_bounds.py, spec_trees.py) and of
scripts/measure_tree_choices.py, against hand computations and brute-force references; plus the shipped Medusa
choice lists against the committed counts they were picked from."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from hf_kvspec.speculative.stats import AcceptanceStats
from hf_kvspec.speculative.tree import DEFAULT_CHOICES, SMALL_CHOICES, best_choices

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import measure_tree_choices as measure  # noqa: E402

from bench import spec_bounds, spec_trees  # noqa: E402


def _brute_monotone(values: list[float]) -> list[float]:
    """Reference for the non-decreasing least-squares fit: the best of all fits that are constant on blocks of
    consecutive points (the optimum has that form), each block at its mean."""
    best, best_err = None, float("inf")
    n = len(values)
    for cuts in itertools.product([False, True], repeat=n - 1):
        fit, start = [], 0
        for end in [i + 1 for i, cut in enumerate(cuts) if cut] + [n]:
            block = values[start:end]
            fit += [sum(block) / len(block)] * len(block)
            start = end
        if all(a <= b + 1e-12 for a, b in itertools.pairwise(fit)):
            err = sum((f - v) ** 2 for f, v in zip(fit, values))
            if err < best_err:
                best, best_err = fit, err
    return best


@pytest.mark.parametrize("seed", range(5))
def test_monotone_fit_equals_brute_force(seed):
    values = torch.rand(7, generator=torch.Generator().manual_seed(seed)).mul(3).add(1).tolist()
    table = dict(zip([1, 2, 4, 8, 16, 32, 64], values))
    fitted = spec_bounds.monotone(table)
    assert list(fitted.values()) == pytest.approx(_brute_monotone(values), abs=1e-3)  # rounded to 3 decimals


def test_monotone_keeps_a_non_decreasing_table():
    table = {1: 1.0, 2: 1.2, 4: 1.2, 8: 2.5}
    assert spec_bounds.monotone(table) == table


def test_interpolate_linear_and_clamped():
    table = {1: 1.0, 3: 2.0, 5: 4.0}
    assert spec_bounds.interpolate(table, 2) == 1.5
    assert spec_bounds.interpolate(table, 4) == 3.0
    assert spec_bounds.interpolate(table, 0) == 1.0 and spec_bounds.interpolate(table, 9) == 4.0


def test_speedup_bound_by_hand():
    cost_v = {1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0}
    # rounds verifying 1 and 3 nodes: c_v(2) = 1.5, c_v(4) = 2.0 -> mean 1.75; draft 0.02 s / 0.1 s = 0.2 steps
    bound, verify, draft = spec_bounds.speedup_bound(2.0, [1, 3], 0.02, 0.1, cost_v)
    assert (verify, draft) == pytest.approx((1.75, 0.2))
    assert bound == pytest.approx(2.0 / 1.95)
    # bs=2: forwards over 2 (N + 1) tokens against one bs=2 step: c_v(4) / c_v(2), c_v(8) / c_v(2)
    bound, verify, draft = spec_bounds.speedup_bound(2.0, [1, 3], 0.03, 0.1, cost_v, batch=2)
    assert (verify, draft) == pytest.approx(((2.0 + 3.0) / 2 / 1.5, 0.2))


def test_new_tokens_counts_to_the_first_eos():
    sequences = torch.tensor([[9, 9, 1, 2, 0, 5], [9, 9, 1, 2, 3, 4]])
    assert spec_bounds.new_tokens(sequences, 2, eos_id=0) == 3 + 4


def test_per_depth_pools_calls_and_cuts_unoffered_positions():
    first, second = AcceptanceStats(), AcceptanceStats()
    first.drafted, first.accepted = [4, 2, 1, 0], [2, 1, 0, 0]
    second.drafted, second.accepted = [4, 3], [3, 1]
    assert spec_bounds.per_depth([first, second]) == [0.625, 0.4, 0.0]


def _sample(seconds, sequences, stats=None):
    return {"seconds": seconds, "sequences": torch.tensor(sequences), "prompt_len": 1, "stats": stats}


def _stats(emitted, row_rounds, lengths, draft_s):
    stats = AcceptanceStats(rounds=len(lengths), row_rounds=row_rounds, emitted_tokens=emitted,
                            draft_time_s=draft_s, draft_lengths=lengths)
    stats.drafted, stats.accepted = [row_rounds], [emitted - row_rounds]
    return stats


def test_aggregate_rows_medians_bound_and_identity_check():
    cost_v = {1: 1.0, 2: 1.5, 4: 2.0}
    same, other = [[7, 1, 2, 3, 4]], [[7, 1, 2, 9, 4]]
    samples = {(1, "greedy", 0): {
        "plain": [_sample(4.0, same), _sample(2.0, same), _sample(3.0, same)],
        "m": [_sample(1.0, same, _stats(4, 2, [1, 1], 0.2)), _sample(9.0, other, _stats(4, 2, [1, 1], 0.2)),
              _sample(2.0, same, _stats(4, 2, [1, 1], 0.2))]}}
    plain, method = spec_bounds.aggregate_rows(samples, ["plain", "m"], cost_v, step_s=0.5, eos_id=None)
    assert plain["tokens_per_s"] == round(4 / 3.0, 2) and plain["equals_plain"] is True  # median of 2, 3, 4 s
    assert method["speed_vs_plain"] == pytest.approx(round((4 / 2.0) / (4 / 3.0), 3))  # median of 1, 2, 9 s
    # tau 2, c_v(2) = 1.5, draft 0.1 s per round / 0.5 s = 0.2 steps
    assert method["tau"] == 2.0 and method["bound"] == pytest.approx(round(2 / 1.7, 3))
    assert method["equals_plain"] == "1 runs differ"
    assert method["accept_by_depth"] == [1.0]


def test_target_checks_read_the_rows():
    rows = [dict(batch=1, mode="greedy", method="plain", tau=1.0, speed_vs_plain=1.0, speed_over_bound=1.0,
                 equals_plain=True),
            dict(batch=1, mode="greedy", method="eagle:chain:4", tau=2.0, speed_vs_plain=0.8, speed_over_bound=0.9,
                 equals_plain=True),
            dict(batch=1, mode="greedy", method="eagle:dynamic:5:4:24", tau=3.0, speed_vs_plain=0.9,
                 speed_over_bound=0.8, equals_plain="2 runs differ"),
            dict(batch=1, mode="t=0.7", method="eagle:chain:4", tau=1.5, speed_vs_plain=0.8, speed_over_bound=0.9,
                 equals_plain="")]
    notes = spec_bounds.target_checks(rows)
    assert "target tau: eagle:dynamic:5:4:24 tau 3.0 = 1.50x eagle:chain:4 tau 2.0 (bs=1 greedy)." in notes
    assert "target t=0.7: eagle:chain:4 keeps 75% of its greedy tau." in notes
    assert notes[-1] == "greedy outputs NOT identical to plain: ['eagle:dynamic:5:4:24 bs=1']."


def test_method_names_are_checked():
    with pytest.raises(SystemExit, match="unknown method"):
        spec_trees.make_assistant("medusa:chain:3", heads=None)
    with pytest.raises(SystemExit, match="unknown method"):
        spec_trees.make_assistant("eagle:dynamic:5:4", heads=None)
    with pytest.raises(SystemExit, match="unknown option"):
        spec_trees.make_assistant("eagle:chain:4@vocab", heads=None)
    assert spec_trees._options("m", ["vocab4096", "auto"]) == {"draft_vocab_size": 4096, "num_draft_tokens": "auto"}
    with pytest.raises(SystemExit, match="one @head=NAME"):
        spec_trees.head_option("eagle:defaults@head=a@head=b")


def test_defaults_and_a_second_head_in_one_run():
    """``eagle:defaults`` is the assistant a new user gets; ``@head=NAME`` picks a bundled head by name and is not
    an assistant option."""
    from hf_kvspec.heads.configuration import EagleConfig
    from hf_kvspec.heads.modeling_eagle import EagleHead
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", seed=0)
    head = EagleHead(EagleConfig.for_base_model(model, "tiny")).attach(model).eval()
    plain, named = spec_trees.make_assistant("eagle:defaults", head), spec_trees.make_assistant(
        "eagle:defaults@head=eagle_v2@auto", head)
    assert type(plain).__name__ == type(named).__name__ == "EagleAssistant"
    assert spec_trees.head_option("eagle:defaults@head=eagle_v2@auto") == "eagle_v2"
    assert spec_trees.head_option("eagle:chain:4@vocab64") is None


def test_head_path_loads_a_trained_folder_in_place_of_the_bundled_head(tmp_path):
    from hf_kvspec.heads.configuration import EagleConfig
    from hf_kvspec.heads.modeling_eagle import EagleHead
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", seed=0)
    torch.manual_seed(0)
    saved = EagleHead(EagleConfig.for_base_model(model, "tiny", feature_layers=[0, 1, 2], architecture="eagle3",
                                                  draft_vocab_size=16))
    saved.save_pretrained(tmp_path)
    loaded = spec_trees.load_heads("eagle", model, str(tmp_path))
    assert loaded.config.architecture == "eagle3" and not loaded.training
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(SystemExit, match="medusa or eagle"):
        spec_trees.load_heads("early_exit", model, str(tmp_path))


def test_held_out_prompts_spread_evenly():
    everything = spec_trees.held_out_prompts(10_000)
    picked = spec_trees.held_out_prompts(5)
    assert len(everything) == 35 and len(set(picked)) == 5
    assert picked == [everything[i] for i in (0, 7, 14, 21, 28)]


# ---------------------------------------------------------------------------------------------- measuring
def test_true_token_ranks_against_argsort():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, 50, generator=generator)  # distinct scores: ranks are unambiguous
    ids = torch.randint(0, 50, (12,), generator=generator)
    ranks = measure.true_token_ranks(logits, ids, start=2)
    order = logits.argsort(dim=-1, descending=True)
    for k in range(3):
        for p, t in enumerate(range(2, 12 - 3 - 1)):
            assert int(ranks[k, p]) == int((order[k, t] == ids[t + k + 2]).nonzero())


def test_rank_tuples_and_prefix_counts_by_hand():
    ranks = torch.tensor([[0, 1, 0, 9], [0, 0, 5, 0], [2, 0, 0, 0]])  # [K=3, P=4]
    tuples = measure.rank_tuples(ranks, max_rank=4)
    assert tuples == [(0, 0, 2), (1, 0, 0), (0,), ()]
    counts = measure.prefix_counts(tuples)
    assert counts == {(0,): 2, (0, 0): 1, (0, 0, 2): 1, (1,): 1, (1, 0): 1, (1, 0, 0): 1}


def test_expected_tau_equals_simulated_greedy_acceptance():
    """Independent reference: walk each position's true ranks down the tree, as greedy verification does."""
    generator = torch.Generator().manual_seed(1)
    ranks = torch.randint(0, 3, (3, 400), generator=generator)
    tuples = measure.rank_tuples(ranks, max_rank=3)
    values = {c: n / len(tuples) for c, n in measure.prefix_counts(tuples).items()}
    choices = best_choices(values, 6)
    accepted = 0
    for ranks_here in tuples:
        depth = 0
        while depth < len(ranks_here) and ranks_here[:depth + 1] in choices:
            depth += 1
        accepted += depth
    assert measure.expected_tau(values, choices) == pytest.approx(1 + accepted / len(tuples))


def test_counts_round_trip_through_json():
    counts = {(0,): 5, (1,): 1, (0, 0): 3}
    payload = {"positions": 10, "counts": measure.encode_counts(counts, min_count=2)}
    assert list(payload["counts"]) == ["0", "0,0"]
    assert measure.decode_values(json.loads(json.dumps(payload))) == {(0,): 0.5, (0, 0): 0.3}


def test_shipped_lists_are_the_committed_measurement():
    """tree.py's "small" and "default" lists are best_choices over the committed counts, at the sizes the cost
    model picked (benchmarks/results/spec_tree_choices.json, written by scripts/measure_tree_choices.py)."""
    payload = json.loads((SCRIPTS.parent / "benchmarks" / "results" / "spec_tree_choices.json").read_text())
    values = measure.decode_values(payload)
    for name, shipped in (("small", SMALL_CHOICES), ("default", DEFAULT_CHOICES)):
        picked = payload["shipped"][name]
        assert shipped == best_choices(values, picked["nodes"]) == tuple(tuple(c) for c in picked["choices"])
    assert DEFAULT_CHOICES[:payload["shipped"]["cost_model_default"]["nodes"]] == tuple(
        tuple(c) for c in payload["shipped"]["cost_model_default"]["choices"])  # the prefix tree.py's note names
