"""Fine-tuning a trained head (``--init_from``): weights copied exactly, draft vocabularies re-chosen or kept, and
every mismatch refused before training starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.heads.pairing import BaseModelMismatchError
from hf_kvspec.heads.trained_vocab import init_draft_vocab
from hf_kvspec.heads.warm_start import LAYOUT_CHANGE_KEEPS, warm_start
from tests.tiny_models import tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_drafter.py"


@pytest.fixture
def base():
    return tiny_model("llama", seed=0, vocab_size=64, hidden_size=32, intermediate_size=64)


def _eagle(base, seed: int, **kwargs) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead(EagleConfig.for_base_model(base, "tiny", **kwargs)).attach(base).eval()


def _saved(head, directory: Path) -> Path:
    head.save_pretrained(directory)
    return directory


def _draft_logits(head, base, seed: int = 1) -> torch.Tensor:
    """Logits of one draft step over a random prompt's features, [1, T, V or N]."""
    torch.manual_seed(seed)
    ids = torch.randint(3, 64, (1, 7))
    with torch.no_grad():
        hidden = base(ids, output_hidden_states=True).hidden_states
        return head(ids, features=head.collect_features(hidden)).logits


def test_copy_is_bit_exact(base, tmp_path):
    source = _eagle(base, seed=1)
    fresh = _eagle(base, seed=2)
    assert not torch.equal(_draft_logits(source, base), _draft_logits(fresh, base))  # the seeds really differ
    report = warm_start(fresh, str(_saved(source, tmp_path / "src")), base)
    assert report.draft_vocab is None and report.tensors_copied == len(source.state_dict())
    assert report.parameters_copied == sum(t.numel() for t in source.state_dict().values())
    for name, tensor in source.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert torch.equal(_draft_logits(fresh, base), _draft_logits(source, base))


def test_full_vocabulary_source_seeds_a_draft_vocabulary_head(base, tmp_path):
    source = _eagle(base, seed=1)
    head = _eagle(base, seed=2, draft_vocab_size=10)
    report = warm_start(head, str(_saved(source, tmp_path / "src")), base)
    assert report.draft_vocab == "from data"
    ids = torch.tensor([3, 5, 8, 13, 21, 34, 40, 50, 60, 63])
    init_draft_vocab(head, ids)  # what train_drafter does next: the base LM head's rows
    # the layers are the source's and the projection is the base rows, so the draft logits are the source's
    # full-vocabulary logits at the kept ids
    assert torch.allclose(_draft_logits(head, base), _draft_logits(source, base)[..., ids], atol=1e-6)


def test_same_draft_vocabulary_is_kept(base, tmp_path):
    source = _eagle(base, seed=1, draft_vocab_size=10)
    source.set_draft_vocab(torch.arange(20, 30))
    head = _eagle(base, seed=2, draft_vocab_size=10)
    assert warm_start(head, str(_saved(source, tmp_path / "src")), base).draft_vocab == "from source"
    assert torch.equal(head.draft_vocab_ids(), torch.arange(20, 30))
    assert torch.equal(head.lm_head.weight, source.lm_head.weight)


def test_layout_change_copies_the_layer_after_its_attention_only(base, tmp_path):
    source = _saved(_eagle(base, seed=1), tmp_path / "eagle1")          # eagle1, feature_layers [-1], full vocabulary
    head = _eagle(base, seed=2, architecture="eagle3", feature_layers=[1, 2], draft_vocab_size=10)
    fresh = {name: tensor.clone() for name, tensor in head.state_dict().items()}
    report = warm_start(head, str(source), base, across_layouts=True)
    theirs = load_file(source / "model.safetensors")
    kept = sorted(name for name in fresh if name.startswith(LAYOUT_CHANGE_KEEPS))
    assert kept == sorted(["layer.self_attn.o_proj.weight", "layer.post_attention_layernorm.weight", "norm.weight",
                           "layer.mlp.gate_proj.weight", "layer.mlp.up_proj.weight", "layer.mlp.down_proj.weight"])
    assert report.layout_change == "eagle1 -> eagle3" and report.draft_vocab == "from data"
    assert report.tensors_copied == len(kept) and report.left_fresh == sorted(set(fresh) - set(kept) - {"lm_head.weight", "d2t", "t2d"})
    for name, tensor in head.state_dict().items():  # copied bit for bit; everything else keeps its fresh init
        assert torch.equal(tensor, theirs[name].float() if name in kept else fresh[name]), name
    assert {"fuse.weight", "hidden_norm.weight", "layer.self_attn.q_proj.weight"} <= set(report.left_fresh)
    back = _eagle(base, seed=3, draft_vocab_size=10)                     # the reverse direction; same draft size,
    report = warm_start(back, str(_saved(head, tmp_path / "eagle3")), base, across_layouts=True)
    assert (report.layout_change, report.draft_vocab) == ("eagle3 -> eagle1", "from data")  # but no projection
    with pytest.raises(ValueError, match="--init_across_layouts true"):  # asked for by name only
        warm_start(_eagle(base, 2, architecture="eagle3", feature_layers=[1, 2]), str(source), base)


def test_refusals_name_the_difference(base, tmp_path):
    eagle1 = _saved(_eagle(base, seed=1), tmp_path / "eagle1")
    with pytest.raises(ValueError, match="hf_kvspec_eagle head, but this run trains a hf_kvspec_medusa"):
        warm_start(MedusaHeads(MedusaConfig.for_base_model(base, "tiny")).attach(base), str(eagle1), base)
    with pytest.raises(ValueError, match="architecture='eagle1' there, 'eagle3' here"):
        warm_start(_eagle(base, 2, architecture="eagle3", feature_layers=[1, 2]), str(eagle1), base)
    vocab = _saved(_eagle(base, seed=1, draft_vocab_size=10), tmp_path / "vocab")
    with pytest.raises(ValueError, match="--draft_vocab_size 10"):
        warm_start(_eagle(base, seed=2), str(vocab), base)
    four = _saved(MedusaHeads(MedusaConfig.for_base_model(base, "tiny", num_heads=4)), tmp_path / "medusa4")
    with pytest.raises(ValueError, match=r"not in this head: .*heads\.3.*num_heads: 4 there, 3 here"):
        warm_start(MedusaHeads(MedusaConfig.for_base_model(base, "tiny", num_heads=3)).attach(base), str(four), base)
    from hf_kvspec.heads.configuration_exit import ExitAdapterConfig
    from hf_kvspec.heads.modeling_exit import ExitAdapter

    deep = tiny_model("llama", seed=0, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3)

    def exit_adapter(layer):
        return ExitAdapter(ExitAdapterConfig.for_base_model(deep, "tiny", exit_layer=layer)).attach(deep)

    exit1 = _saved(exit_adapter(1), tmp_path / "exit1")
    with pytest.raises(ValueError, match="exit_layer=1 there, 2 here"):  # same shapes, other layer's states
        warm_start(exit_adapter(2), str(exit1), deep)
    assert warm_start(exit_adapter(1), str(exit1), deep).tensors_copied > 0
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        warm_start(_eagle(base, seed=2), str(tmp_path / "nowhere"), base)
    other_base = tiny_model("llama", seed=5, vocab_size=64, hidden_size=32, intermediate_size=64)
    with pytest.raises(BaseModelMismatchError):  # the source was trained for `base`, not this one
        warm_start(_eagle(other_base, seed=2), str(eagle1), other_base)


def test_train_drafter_init_from_at_zero_learning_rate_keeps_the_source(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import train_drafter

    from tests.heads.tiny_base import save_tiny_base, write_tiny_corpus

    save_tiny_base(tmp_path / "base")
    write_tiny_corpus(tmp_path / "corpus.txt")
    common = ["--head", "eagle", "--base_model", str(tmp_path / "base"), "--dataset", str(tmp_path / "corpus.txt"),
              "--label_source", "data", "--per_device_batch_size", "4", "--warmup_steps", "0", "--num_threads", "1",
              "--data_cache_dir", str(tmp_path / "cache")]
    train_drafter.main([*common, "--max_steps", "3", "--learning_rate", "1e-2", "--output_dir", str(tmp_path / "a")])
    # lr 0: AdamW leaves every weight where --init_from put it, so the saved head is the source, bit for bit
    train_drafter.main([*common, "--max_steps", "2", "--learning_rate", "0", "--init_from", str(tmp_path / "a"),
                        "--output_dir", str(tmp_path / "b")])
    before, after = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    summary = json.loads((tmp_path / "b" / "training_summary.json").read_text())
    assert summary["initialised_from"]["source"] == str(tmp_path / "a")
    assert summary["initialised_from"]["tensors_copied"] == len(before)
    first = json.loads((tmp_path / "a" / "training_summary.json").read_text())
    lineage = summary["initialised_from"]["source_training"]
    assert lineage["steps"] == 3 and lineage["tokens"] == sum(row["tokens"] for row in first["data"]) > 0
    assert f"itself trained for 3 steps on {lineage['tokens']:,} tokens" in (tmp_path / "b" / "README.md").read_text()
