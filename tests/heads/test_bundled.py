"""The committed heads for the bundled SmolLM2: load, pair, stay small, and (slow) still measure what their card says."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_kvspec import load_bundled_heads
from hf_kvspec.heads.bundled import bundled_heads_path, head_path
from hf_kvspec.heads.data import read_prompts
from hf_kvspec.heads.pairing import BaseModelMismatchError, base_model_fingerprint
from tests.tiny_models import tiny_model


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle_v2"])
def test_bundled_heads_load_and_pair(bundled, kind):
    model, _ = bundled
    head = load_bundled_heads(kind, base_model=model)
    assert head.config.base_model_fingerprint == base_model_fingerprint(model)
    assert head.config.base_model_name_or_path == "bundled:smollm2-135m-instruct"
    stored = load_file(str(bundled_heads_path(kind) / "model.safetensors"))
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert not [n for n, t in stored.items() if tuple(t.shape) == (vocab, hidden)]  # 28M-parameter embedding/LM head
    assert sum(t.numel() for t in stored.values()) < 12_000_000  # borrowed; eagle3 stores its [8192, H] draft head
    ids = torch.tensor([[1, 504, 3458, 281, 253]])
    out = model(ids, output_hidden_states=True)
    if kind == "medusa":
        assert head(out.hidden_states[-1]).logits.shape == (4, 1, 5, vocab)
    else:
        width = head.config.draft_vocab_size or vocab
        assert head(ids, features=head.collect_features(out.hidden_states)).logits.shape == (1, 5, width)
    card = (bundled_heads_path(kind) / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "Chain τ" in card


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle_v2"])
def test_bundled_cards_are_their_training_summaries_rendered(kind):
    """The committed cards are exactly what the renderer makes of the committed training summaries: the printed
    figures and the model-index values are the held-out numbers measured at training time."""
    from huggingface_hub import ModelCard

    from hf_kvspec import hub
    from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig

    folder = bundled_heads_path(kind)
    summary = json.loads((folder / "training_summary.json").read_text())
    config = (MedusaConfig if kind == "medusa" else EagleConfig).from_pretrained(folder)
    card = (folder / "README.md").read_text()
    assert card == hub.render_model_card(config, hub.CardFields.from_summary(summary))
    held_out = summary["held_out"]
    assert f"τ = {held_out['tau']:.2f}" in card and f"{held_out['target_forwards']} target forwards" in card
    for top1 in held_out["per_head_top1"]:
        assert f"| {100 * top1:.1f}% |" in card
    values = [result.metric_value for result in ModelCard(card).data.eval_results]
    assert values == [round(held_out["tau"], 4)] + [round(x, 4) for x in held_out["per_head_top1"]]


def test_bundled_heads_refuse_another_base():
    with pytest.raises(BaseModelMismatchError):
        load_bundled_heads("medusa", base_model=tiny_model("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle_v2"])
def test_card_numbers_reproduce(bundled, kind):
    """Re-measure on the held-out prompts (cached greedy answers regenerate if missing; ~3 min per head)."""
    from hf_kvspec.heads.distill import DistillSettings, self_distill
    from hf_kvspec.heads.evaluation import evaluate_head
    from hf_kvspec.models import cache_dir

    model, tokenizer = bundled
    head = load_bundled_heads(kind, base_model=model)
    summary = json.loads((bundled_heads_path(kind) / "training_summary.json").read_text())
    prompts = read_prompts(summary["held_out"]["source"])
    convs = self_distill(model, tokenizer, prompts, cache_dir() / "drafter_data" / "self_distill.jsonl",
                         base_model_fingerprint(model), DistillSettings(max_new_tokens=128), progress=False)
    measured = evaluate_head(head, model, convs)
    # fp16 storage of the head vs the fp32 head that was measured: a handful of argmax flips at most
    assert measured["tau"] == pytest.approx(summary["held_out"]["tau"], abs=0.05)
    for found, expected in zip(measured["per_head_top1"], summary["held_out"]["per_head_top1"]):
        assert found == pytest.approx(expected, abs=0.02)


def test_unknown_bundled_head_kind_names_the_kinds():
    from hf_kvspec.heads.bundled import load_bundled_heads

    with pytest.raises(ValueError, match=r"kind must be one of .*'hydra'"):
        load_bundled_heads("hydra")


def test_head_path_reads_bundled_specs_and_leaves_paths_alone(tmp_path):
    """One reading of ``bundled:KIND`` for ``export-heads`` and ``--init_from``."""
    from pathlib import Path

    from hf_kvspec.heads.warm_start import resolve_source

    assert head_path("bundled:eagle") == bundled_heads_path("eagle") == resolve_source("bundled:eagle")
    assert head_path(str(tmp_path / "mine")) == tmp_path / "mine"
    assert head_path("bundled") == Path("bundled")  # no kind given: a plain relative path
    with pytest.raises(ValueError, match="medusa"):
        head_path("bundled:nope")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_source(str(tmp_path))


def test_export_heads_takes_a_bundled_head_by_kind(tmp_path, capsys):
    """``export-heads bundled:KIND``: the committed Medusa heads go to vLLM's Medusa layout (their weights intact);
    the committed EAGLE-1 head v2 (``eagle_v2``), which neither engine loads, is refused naming the fix."""
    from hf_kvspec.cli import main

    assert main(["export-heads", "bundled:medusa", "--format", "vllm-medusa", "--out", str(tmp_path / "m")]) == 0
    exported = load_file(str(tmp_path / "m" / "model.safetensors"))
    stored = load_file(str(bundled_heads_path("medusa") / "model.safetensors"))
    for k in range(4):  # vLLM names head k's residual block blocks.k.layers.0
        for part in ("weight", "bias"):
            assert torch.equal(exported[f"blocks.{k}.layers.0.{part}"], stored[f"heads.{k}.blocks.0.linear.{part}"])
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_heads"] == 4
    capsys.readouterr()
    assert main(["export-heads", "bundled:eagle_v2", "--format", "speculators", "--out", str(tmp_path / "e")]) == 2
    assert "Retrain with --architecture eagle3" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_bundled_eagle_head_exports_and_reimports_bit_exact(bundled, tmp_path, fmt):
    """The bundled ``"eagle"`` head (EAGLE-3 layout) goes to both serving layouts through the CLI; importing the
    export back gives the same draft logits, bit for bit, and the same draft vocabulary."""
    from hf_kvspec.cli import main
    from hf_kvspec.heads.import_formats import import_head

    model, _ = bundled
    assert main(["export-heads", "bundled:eagle", "--format", fmt, "--out", str(tmp_path)]) == 0
    head = load_bundled_heads("eagle", base_model=model)
    back = import_head(tmp_path, model)  # the export keeps the committed fp16; the import computes in fp32
    assert next(back.parameters()).dtype == torch.float32
    assert back.config.architecture == head.config.architecture == "eagle3"
    assert back.config.feature_layers == head.config.feature_layers
    ids = torch.tensor([[1, 504, 3458, 281, 253, 1095]])
    hidden = model(ids, output_hidden_states=True).hidden_states
    with torch.no_grad():
        ours = head(ids, features=head.collect_features(hidden)).logits
        theirs = back(ids, features=back.collect_features(hidden)).logits
    assert torch.equal(theirs, ours)
    assert torch.equal(back.draft_vocab_ids(), head.draft_vocab_ids())


def test_bundled_eagle_speculators_config_validates_with_the_package(bundled, tmp_path):
    """The real ``speculators`` config class reads the export, where the package is installed (it cannot be beside
    transformers 5.x, so CI skips this)."""
    speculators = pytest.importorskip("speculators.models", reason="speculators not installed")
    from hf_kvspec.cli import main

    model, _ = bundled
    assert main(["export-heads", "bundled:eagle", "--format", "speculators", "--out", str(tmp_path)]) == 0
    config = speculators.Eagle3SpeculatorConfig.model_validate(json.loads((tmp_path / "config.json").read_text()))
    assert config.draft_vocab_size == load_bundled_heads("eagle").config.draft_vocab_size == 8192
    assert config.target_vocab_size == model.config.vocab_size and config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]


def test_earlier_bundled_head_loads_by_name():
    """v2 stays loadable by name after v3 took the ``"eagle"`` slot: a different layout, not a copy."""
    from hf_kvspec.heads.bundled import EARLIER_HEADS, HEAD_KINDS

    assert set(EARLIER_HEADS.values()) <= set(HEAD_KINDS)
    v2, v3 = load_bundled_heads("eagle_v2"), load_bundled_heads("eagle")
    assert (v2.config.architecture, v3.config.architecture) == ("eagle1", "eagle3")
    assert head_path("bundled:eagle_v2") == bundled_heads_path("eagle_v2") != bundled_heads_path("eagle")
