"""Model-card rendering and the exact Hub upload (through huggingface_hub's real upload_folder, no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from huggingface_hub import CommitInfo, HfApi, RepoUrl
from safetensors.torch import load

from hf_kvspec import hub
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from tests.tiny_models import tiny_model

HELD_OUT = {"per_head_top1": [0.5734, 0.3121, 0.2, 0.1], "tau": 2.4567, "positions": [900, 880, 860, 840],
            "emitted_tokens": 901, "target_forwards": 367, "prompts": 35, "source": "heldout.jsonl"}


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama", seed=0)


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_card_carries_metadata_and_measured_numbers(base):
    config = MedusaConfig.for_base_model(base, "bundled:tiny", num_heads=4)
    fields = hub.CardFields(base_model_hub_id="org/tiny-base", datasets=["corpus:python-docs", "prompts.jsonl"],
                            command="accelerate launch scripts/train_drafter.py --head medusa", held_out=HELD_OUT,
                            data=[{"source": "corpus:python-docs", "kind": "text", "sequences": 3, "tokens": 700}],
                            repo_id="me/heads")
    card = hub.render_model_card(config, fields)
    meta = _front_matter(card)
    assert meta["library_name"] == "hf_kvspec" and meta["base_model"] == "org/tiny-base"
    assert meta["license"] == "apache-2.0" and meta["datasets"] == ["corpus:python-docs", "prompts.jsonl"]
    assert {"speculative-decoding", "medusa"} <= set(meta["tags"])
    assert meta["hf_kvspec_acceptance"] == {"tau": 2.4567, "per_head_top1": [0.5734, 0.3121, 0.2, 0.1]}
    for text in ("57.3%", "31.2%", "τ = 2.46", "35 chat prompts", "367 target forwards", config.base_model_fingerprint,
                 "accelerate launch scripts/train_drafter.py --head medusa", "| `corpus:python-docs` | text | 3 | 700 |",
                 "assistant=", 'AutoModel.from_pretrained("me/heads")', "## Limitations"):
        assert text in card, text


def test_card_training_paragraph_reports_a_time_capped_run(base):
    summary = {"args": {"max_steps": 3000, "per_device_batch_size": 32, "gradient_accumulation_steps": 1,
                        "learning_rate": 5e-4, "warmup_steps": 100, "label_source": "target",
                        "max_train_seconds": 270.0, "mixed_precision": "bf16"},
               "training_vocab_size": 49152, "train_seconds": 270.1, "stopped_at_step": 1405}
    card = hub.render_model_card(EagleConfig.for_base_model(base, "bundled:tiny"), hub.CardFields.from_summary(summary))
    assert "after 1405 of the 3000 steps" in card and "--max_train_seconds 270.0" in card and "bf16" in card
    finished = hub.render_model_card(EagleConfig.for_base_model(base, "bundled:tiny"),
                                     hub.CardFields.from_summary({**summary, "stopped_at_step": None}))
    assert "3000 optimizer steps" in finished and "stopped by" not in finished


def test_card_states_cpu_hours_and_the_export_command_its_layout_takes(base):
    """The training cost in CPU-hours when the run recorded it; the serving section names the export each layout
    takes: speculators and SGLang for an EAGLE-3 layer, vLLM's Medusa layout for Medusa, a refusal for EAGLE-1."""
    summary = {"args": {"max_steps": 10}, "train_seconds": 3600.0, "cpu_seconds": 3 * 7200.0}
    fields = hub.CardFields.from_summary(summary, repo_id="me/head")
    eagle3 = hub.render_model_card(EagleConfig.for_base_model(base, "bundled:tiny", feature_layers=[0, 1, 2],
                                                              architecture="eagle3"), fields)
    assert "Training cost: 6.0 CPU-hours" in eagle3
    assert "hf download me/head --local-dir head" in eagle3
    assert "export-heads head --format speculators" in eagle3 and "export-heads head --format sglang" in eagle3
    eagle1 = hub.render_model_card(EagleConfig.for_base_model(base, "bundled:tiny"),
                                   hub.CardFields.from_summary({**summary, "cpu_seconds": None}))
    assert "refuses it" in eagle1 and "--format" not in eagle1 and "CPU-hours" not in eagle1
    medusa = hub.render_model_card(MedusaConfig.for_base_model(base, "bundled:tiny", num_heads=2), fields)
    assert "export-heads head --format vllm-medusa" in medusa and "sglang" not in medusa


def test_card_without_measurements_says_so(base):
    card = hub.render_model_card(EagleConfig.for_base_model(base, "bundled:tiny"))
    assert "Not measured" in card and "hf_kvspec_acceptance" not in _front_matter(card)
    assert "EAGLE" in card


def test_push_uploads_exactly_weights_config_and_card(base, monkeypatch):
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        calls["files"] = {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations}
        calls["commit"] = (repo_id, kwargs)
        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/abc", commit_message="m",
                          commit_description="", oid="abc")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    heads = MedusaHeads(MedusaConfig.for_base_model(base, "bundled:tiny", num_heads=2)).attach(base)
    url = heads.push_to_hub("me/tiny-medusa", private=True, held_out=HELD_OUT)
    assert url == "https://huggingface.co/me/tiny-medusa/commit/abc"
    assert calls["create_repo"][0] == "me/tiny-medusa" and calls["create_repo"][1]["private"] is True
    assert sorted(calls["files"]) == ["README.md", "config.json", "model.safetensors"]
    assert "57.3%" in calls["files"]["README.md"].decode()
    assert _front_matter(calls["files"]["README.md"].decode())["base_model"] == "bundled:tiny"
    weights = load(calls["files"]["model.safetensors"])
    assert sorted(weights) == sorted(heads.state_dict())  # the head only: no embedding, no LM head


def test_card_template_ships_inside_the_package():
    """``hf_kvspec/model_cards`` links to the top-level templates and is package data, so wheels render cards too."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    assert (hub.TEMPLATE_DIR / hub.DEFAULT_TEMPLATE).resolve() == (root / "model_cards" / hub.DEFAULT_TEMPLATE)
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "model_cards/*.md" in package_data["hf_kvspec"]


def test_card_model_index_reads_back_through_huggingface_hub(base):
    """The held-out results are ``model-index`` rows the Hub's own parser reads back (what the Hub displays)."""
    from huggingface_hub import ModelCard

    config = MedusaConfig.for_base_model(base, "bundled:tiny", num_heads=4)
    card = hub.render_model_card(config, hub.CardFields(held_out=HELD_OUT, repo_id="me/heads"))
    data = ModelCard(card).data
    assert data.model_name == "me/heads"
    values = {result.metric_name: result.metric_value for result in data.eval_results}
    assert values == {"Chain τ (tokens per target forward)": 2.4567, "Top-1 agreement, draft position 1": 0.5734,
                      "Top-1 agreement, draft position 2": 0.3121, "Top-1 agreement, draft position 3": 0.2,
                      "Top-1 agreement, draft position 4": 0.1}
    for result in data.eval_results:
        assert (result.task_type, result.dataset_type, result.metric_type, result.metric_config) == (
            "text-generation", "heldout.jsonl", "draft_acceptance", "chain")
        assert result.dataset_name.startswith("35 held-out chat prompts")
    assert "model-index" not in _front_matter(hub.render_model_card(config))  # nothing measured, nothing claimed
