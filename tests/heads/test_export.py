"""Export to / import from the serving layouts (speculators, SGLang, vLLM Medusa) and the EAGLE-3 draft vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import hf_kvspec
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.export import HeadExportError, export_head
from hf_kvspec.heads.import_formats import import_head
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from tests.tiny_models import tiny_model

H, V, F_LAYERS, N = 64, 96, [1, 2, 3], 40  # tiny_models' llama: hidden 64, vocab 96; 5 layers below


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama", seed=0, num_hidden_layers=5)


def _randomized(head, seed=1):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return head


def eagle3(base, draft_vocab=True, **kwargs):
    config = EagleConfig.for_base_model(base, "tiny-llama", feature_layers=F_LAYERS, architecture="eagle3",
                                        draft_vocab_size=N if draft_vocab else None, **kwargs)
    head = _randomized(EagleHead(config)).attach(base).eval()
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:N])
    return head


def _eagle_logits(head):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (2, 7), generator=gen)
    features = torch.randn(2, 7, len(head.config.feature_layers) * H, generator=gen)
    with torch.no_grad():
        return head(ids, features=features).logits


LAYER_SHAPES = {"self_attn.q_proj.weight": (H, 2 * H), "self_attn.k_proj.weight": (32, 2 * H),
                "self_attn.v_proj.weight": (32, 2 * H), "self_attn.o_proj.weight": (H, H),
                "mlp.gate_proj.weight": (128, H), "mlp.up_proj.weight": (128, H), "mlp.down_proj.weight": (H, 128),
                "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,), "hidden_norm.weight": (H,)}


@pytest.mark.parametrize("fmt,prefix", [("speculators", "layers.0."), ("sglang", "midlayer.")])
def test_eagle3_export_names_shapes_and_bit_exact_reimport(base, tmp_path, fmt, prefix):
    head = eagle3(base)
    export_head(head, fmt, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = {prefix + k: v for k, v in LAYER_SHAPES.items()}
    expected.update({"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (N, H), "d2t": (N,),
                     "t2d": (V,)})
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(N) + tensors["d2t"], torch.nonzero(tensors["t2d"]).flatten())
    config = json.loads((tmp_path / "config.json").read_text())
    if fmt == "sglang":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == N
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang captures id + 1
    else:
        assert config["eagle_aux_hidden_state_layer_ids"] == F_LAYERS
    back = import_head(tmp_path, base)
    assert back.config.feature_layers == F_LAYERS and back.config.draft_vocab_size == N
    assert torch.equal(_eagle_logits(back), _eagle_logits(head))
    assert torch.equal(back.draft_vocab_ids(), head.draft_vocab_ids())


def test_speculators_config_validates_with_the_package(base, tmp_path):
    speculators = pytest.importorskip("speculators.models", reason="speculators not installed")
    export_head(eagle3(base), "speculators", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = speculators.Eagle3SpeculatorConfig.model_validate(raw)
    assert config.draft_vocab_size == N and config.target_vocab_size == V
    assert config.speculators_config.default_proposal_method == "greedy"
    assert config.transformer_layer_config.hidden_size == H and config.eagle_aux_hidden_state_layer_ids == F_LAYERS


def test_borrowed_lm_head_is_written_and_borrowed_again(base, tmp_path):
    head = eagle3(base, draft_vocab=False)
    export_head(head, "speculators", tmp_path)
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["lm_head.weight"], base.lm_head.weight)
    back = import_head(tmp_path, base)
    assert back.lm_head is None and not back.has_draft_vocab
    assert torch.equal(_eagle_logits(back), _eagle_logits(head))


@pytest.mark.parametrize("share", [True, False])
def test_medusa_vllm_layout_round_trip(base, tmp_path, share):
    heads = _randomized(MedusaHeads(MedusaConfig.for_base_model(base, "tiny", num_heads=3, num_layers=2,
                                                                share_lm_head=share))).attach(base).eval()
    export_head(heads, "vllm-medusa", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = {f"blocks.{k}.layers.{j}.{p}": (H, H) if p == "weight" else (H,)
                for k in range(3) for j in range(2) for p in ("weight", "bias")}
    expected.update({"lm_heads.0.weight": (V, H)} if share else {f"lm_heads.{k}.weight": (V, H) for k in range(3)})
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["num_heads"], config["num_hidden_layers"]) == ("medusa", 3, 2)
    back = import_head(tmp_path, base)
    hidden = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(hidden).logits, heads(hidden).logits)


@pytest.mark.parametrize("make,fmt,words", [
    (lambda b: EagleHead(EagleConfig.for_base_model(b, "t")).attach(b), "speculators", "no input norm"),
    (lambda b: EagleHead(EagleConfig.for_base_model(b, "t")).attach(b), "sglang", "fc without bias"),
    (lambda b: MedusaHeads(MedusaConfig.for_base_model(b, "t")).attach(b), "sglang", "no sglang layout"),
    (lambda b: eagle3(b), "vllm-medusa", "no vLLM Medusa layout"),
    (lambda b: EagleHead(EagleConfig.for_base_model(b, "t", feature_layers=[1, 2, -1], architecture="eagle3")),
     "speculators", "final normalised"),
    (lambda b: EagleHead(EagleConfig.for_base_model(b, "t", feature_layers=[1, 3], architecture="eagle3")),
     "sglang", "exactly 3"),
    (lambda b: EagleHead(EagleConfig.for_base_model(b, "t", feature_layers=F_LAYERS, architecture="eagle3",
                                                       norm_before_residual=True)), "sglang", "norm_before_residual"),
])
def test_refusals_say_what_differs(base, tmp_path, make, fmt, words):
    with pytest.raises(HeadExportError, match=words):
        export_head(make(base), fmt, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_draft_vocab_round_trip_and_save_load(base, tmp_path):
    head = eagle3(base)
    vocab = head.draft_vocab_ids()
    assert torch.equal(vocab, vocab.sort().values) and vocab.numel() == N
    assert torch.equal(head.draft_to_target(torch.arange(N)), vocab)
    assert torch.equal(head.target_to_draft(vocab), torch.arange(N))
    outside = torch.tensor(sorted(set(range(V)) - set(vocab.tolist())))
    assert (head.target_to_draft(outside) == -1).all()
    head.save_pretrained(tmp_path)
    again = EagleHead.from_pretrained(tmp_path).attach(base).eval()
    assert torch.equal(again.d2t, head.d2t) and torch.equal(again.t2d, head.t2d)
    assert torch.equal(_eagle_logits(again), _eagle_logits(head))


def test_draft_vocab_head_proposes_only_mapped_ids(base):
    head = eagle3(base)
    logits = _eagle_logits(head)                                   # [B, T, N]
    assert logits.shape[-1] == N
    proposed = head.draft_to_target(logits.topk(5, dim=-1).indices)
    assert set(proposed.flatten().tolist()) <= set(head.draft_vocab_ids().tolist())


def test_set_draft_vocab_refuses_wrong_ids(base):
    head = eagle3(base)
    with pytest.raises(ValueError, match="distinct target ids"):
        head.set_draft_vocab(torch.zeros(N, dtype=torch.long))


def test_imported_eagle3_head_drafts_through_generate(base, tmp_path):
    from hf_kvspec.speculative.drafters.eagle import EagleAssistant

    export_head(eagle3(base, draft_vocab=False), "sglang", tmp_path)
    head = import_head(tmp_path, base)
    ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
    kwargs = dict(do_sample=False, max_new_tokens=10, pad_token_id=0)
    expected = base.generate(ids, **kwargs)
    out = base.generate(ids, custom_generate=hf_kvspec.speculative_generate,
                        assistant=EagleAssistant(head, tree="chain", depth=3), **kwargs)
    assert torch.equal(out, expected)


def test_cli_export_heads_writes_the_layout(base, tmp_path):
    from hf_kvspec.cli import main

    base.save_pretrained(tmp_path / "base")
    heads = MedusaHeads(MedusaConfig.for_base_model(base, str(tmp_path / "base"), num_heads=2))
    heads.save_pretrained(tmp_path / "head")
    assert main(["export-heads", str(tmp_path / "head"), "--format", "vllm-medusa", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_heads"] == 2
    assert main(["export-heads", str(tmp_path / "head"), "--format", "sglang", "--out", str(tmp_path / "x")]) == 2


def test_trained_draft_vocabulary_drafts_only_its_target_ids(base):
    from hf_kvspec.speculative.drafters.eagle import EagleAssistant

    head = eagle3(base)  # a trained draft vocabulary: N random target ids
    allowed = set(head.draft_vocab_ids().tolist())
    proposed: list[int] = []
    assistant = EagleAssistant(head, tree="dynamic", depth=3, top_k=2, total_tokens=6)
    propose = assistant.propose

    def recording(ctx):
        proposal = propose(ctx)
        proposed.extend(proposal.tokens.flatten().tolist())
        return proposal

    assistant.propose = recording
    ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
    kwargs = dict(do_sample=False, max_new_tokens=8, pad_token_id=0)
    out = base.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant, **kwargs)
    assert torch.equal(out, base.generate(ids, **kwargs))
    assert proposed and set(proposed) <= allowed  # draft columns mapped back through d2t
    with pytest.raises(ValueError, match="own draft vocabulary"):
        EagleAssistant(head, draft_vocab_size=4)
