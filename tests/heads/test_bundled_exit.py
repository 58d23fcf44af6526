"""The committed exit adapter for the bundled SmolLM2: loads, pairs, stays small, its card is its summary rendered,
and (slow) the held-out numbers in its summary reproduce."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_kvspec import EarlyExitAssistant, load_bundled_heads
from hf_kvspec.heads.bundled import bundled_heads_path
from hf_kvspec.heads.pairing import BaseModelMismatchError, base_model_fingerprint
from tests.tiny_models import tiny_model


def _summary() -> dict:
    return json.loads((bundled_heads_path("early_exit") / "training_summary.json").read_text())


def test_bundled_exit_adapter_loads_pairs_and_drafts(bundled):
    model, _ = bundled
    adapter = load_bundled_heads("early_exit", base_model=model)
    assert adapter.config.base_model_fingerprint == base_model_fingerprint(model)
    stored = load_file(str(bundled_heads_path("early_exit") / "model.safetensors"))
    assert not [n for n in stored if "embed" in n or "lm_head" in n]
    assert sum(t.numel() for t in stored.values()) < 5_000_000  # the LM head and final norm are borrowed
    ids = torch.tensor([[1, 504, 3458, 281, 253]])
    states = model(ids, output_hidden_states=True).hidden_states[adapter.config.exit_layer]
    assert adapter.logits(states).shape == (1, 5, 49152)
    assert EarlyExitAssistant(None, adapter=adapter).exit_layer == adapter.config.exit_layer


def test_bundled_exit_adapter_refuses_another_base():
    with pytest.raises(BaseModelMismatchError):
        load_bundled_heads("early_exit", base_model=tiny_model("llama", hidden_size=576, vocab_size=49152,
                                                               num_attention_heads=9, num_key_value_heads=3))


def test_bundled_exit_card_is_its_training_summary_rendered():
    from hf_kvspec import hub
    from hf_kvspec.heads.configuration_exit import ExitAdapterConfig

    folder = bundled_heads_path("early_exit")
    summary = _summary()
    config = ExitAdapterConfig.from_pretrained(folder)
    card = (folder / "README.md").read_text()
    assert card == hub.render_model_card(config, hub.CardFields.from_summary(summary, **summary["card"]))
    held_out = summary["held_out"]
    assert f"τ = {held_out['tau']:.2f}" in card and f"| {100 * held_out['per_head_top1'][0]:.1f}% |" in card
    assert f"{summary['decoding_loop']['tau']:.2f}" in card


@pytest.mark.slow
def test_bundled_exit_held_out_numbers_reproduce(bundled):
    """Teacher-forced held-out numbers of the committed (fp16-stored) adapter, re-measured (~2 min)."""
    from hf_kvspec.heads.data import read_prompts
    from hf_kvspec.heads.distill import DistillSettings, self_distill
    from hf_kvspec.heads.evaluation_exit import evaluate_exit_adapter
    from hf_kvspec.models import cache_dir

    model, tokenizer = bundled
    adapter = load_bundled_heads("early_exit", base_model=model)
    summary = _summary()
    convs = self_distill(model, tokenizer, read_prompts(summary["held_out"]["source"]),
                         cache_dir() / "drafter_data" / "self_distill.jsonl", base_model_fingerprint(model),
                         DistillSettings(max_new_tokens=128), progress=False)
    measured = evaluate_exit_adapter(adapter, model, convs)
    # the summary was measured on the same fp16-stored weights: only the answers' batching can flip an argmax
    assert measured["tau"] == pytest.approx(summary["held_out"]["tau"], abs=0.02)
