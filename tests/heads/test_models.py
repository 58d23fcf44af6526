"""Head models: save/load round trip, Auto resolution, base-model pairing, Medusa structure, no borrowed weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel

import hf_kvspec
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_common import HeadNotAttachedError
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.heads.pairing import BaseModelMismatchError, base_model_fingerprint
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama", seed=0)


def _randomized(head, seed=1):
    """Give every parameter non-trivial values (Medusa blocks start at zero, which would hide load bugs)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return head


def _heads(base):
    return [
        _randomized(MedusaHeads(MedusaConfig.for_base_model(base, "tiny-llama", num_heads=3, num_layers=2))),
        _randomized(EagleHead(EagleConfig.for_base_model(base, "tiny-llama"))),
        _randomized(EagleHead(EagleConfig.for_base_model(base, "tiny-llama", feature_layers=[1, 2, -1]))),
    ]


@pytest.mark.parametrize("index", range(3))
def test_round_trip_bit_exact_and_auto_resolution(base, tmp_path, index):
    head = _heads(base)[index].attach(base)
    head.save_pretrained(tmp_path)
    reloaded = type(head).from_pretrained(tmp_path)
    for (name, a), (name_b, b) in zip(head.state_dict().items(), reloaded.state_dict().items()):
        assert name == name_b and torch.equal(a, b), name
    assert reloaded.config.to_diff_dict() == head.config.to_diff_dict()
    hf_kvspec.register()
    hf_kvspec.register()  # idempotent
    try:
        auto = AutoModel.from_pretrained(tmp_path)
        assert type(auto) is type(head)
        assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), auto.state_dict().values()))
    finally:
        hf_kvspec.unregister()


def test_unregister_really_removes(base, tmp_path):
    MedusaHeads(MedusaConfig.for_base_model(base, "tiny")).save_pretrained(tmp_path)
    hf_kvspec.register()
    assert type(AutoConfig.from_pretrained(tmp_path)) is MedusaConfig
    hf_kvspec.unregister()
    hf_kvspec.unregister()  # safe twice
    with pytest.raises((ValueError, KeyError)):
        AutoConfig.from_pretrained(tmp_path)


def test_checkpoint_holds_no_embedding_or_lm_head(base, tmp_path):
    for head in _heads(base):
        head.attach(base).save_pretrained(tmp_path / type(head).__name__)
        names = load_file(str(tmp_path / type(head).__name__ / "model.safetensors")).keys()
        assert not [n for n in names if "embed" in n or "lm_head" in n], names
        assert all(p.shape != base.get_input_embeddings().weight.shape for p in head.parameters())


def test_wrong_base_model_is_refused(base):
    medusa = MedusaHeads(MedusaConfig.for_base_model(base, "tiny-llama"))
    other_weights = tiny_model("llama", seed=1)  # same shapes, different checkpoint
    with pytest.raises(BaseModelMismatchError, match="fingerprint"):
        medusa.attach(other_weights)
    medusa.attach(other_weights, strict=False)  # explicit opt-out
    wider = tiny_model("llama", seed=0, hidden_size=128)
    with pytest.raises(BaseModelMismatchError, match=r"hidden_size=64.*hidden_size=128"):
        medusa.attach(wider, strict=False)  # shapes are never negotiable
    with pytest.raises(BaseModelMismatchError, match="vocab_size"):
        medusa.attach(tiny_model("llama", seed=0, vocab_size=97))


def test_fingerprint_is_dtype_stable(base):
    assert base_model_fingerprint(base) == base_model_fingerprint(tiny_model("llama", seed=0).to(torch.bfloat16))


def test_unattached_head_names_the_fix(base):
    head = MedusaHeads(MedusaConfig.for_base_model(base, "tiny-llama"))
    with pytest.raises(HeadNotAttachedError, match="attach"):
        head(torch.zeros(1, 2, 64))


def test_medusa_parameters_scale_with_distinct_blocks(base):
    counts = [sum(p.numel() for p in MedusaHeads(MedusaConfig.for_base_model(base, "t", num_heads=2,
                                                                             num_layers=n)).parameters())
              for n in (1, 2, 3)]
    block = 64 * 64 + 64
    assert counts == [2 * block, 4 * block, 6 * block]
    heads = MedusaHeads(MedusaConfig.for_base_model(base, "t", num_heads=2, num_layers=3))
    blocks = [b for head in heads.heads for b in head.blocks]
    assert len({id(b) for b in blocks}) == 6 and len({id(b.linear.weight) for b in blocks}) == 6


def test_untrained_medusa_heads_reproduce_the_base_head(base):
    """Zero-initialised residual blocks are the identity: every head starts as the base LM head."""
    heads = MedusaHeads(MedusaConfig.for_base_model(base, "t", num_heads=2)).attach(base)
    ids = torch.randint(3, 96, (2, 7))
    out = base(ids, output_hidden_states=True)
    logits = heads(out.hidden_states[-1]).logits
    assert logits.shape == (2, 2, 7, 96)
    torch.testing.assert_close(logits[0], out.logits)
    torch.testing.assert_close(logits[1], out.logits)


def test_medusa_own_lm_head_is_stored(base):
    heads = MedusaHeads(MedusaConfig.for_base_model(base, "t", num_heads=2, share_lm_head=False))
    assert heads.heads[0].lm_head.weight.shape == (96, 64)
    assert heads.projection_weight(1) is heads.heads[1].lm_head.weight


def test_eagle_reuses_the_base_decoder_layer_class(base):
    drafter = EagleHead(EagleConfig.for_base_model(base, "t"))
    assert type(drafter.layer) is type(base.model.layers[0])
    qwen = tiny_model("qwen2")
    assert type(EagleHead(EagleConfig.for_base_model(qwen, "q")).layer) is type(qwen.model.layers[0])
