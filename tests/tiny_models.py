"""Tiny random models for unit tests: built on CPU in well under a second, fp32, deterministic.

``tiny_config(kind, **overrides)`` / ``tiny_model(kind, seed=0, **overrides)`` with kind in
``TINY_KINDS``. Vocabularies are small so that statistical tests can enumerate distributions.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)

_KINDS: dict[str, dict] = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=1),
    "mistral": dict(model_type="mistral", sliding_window=8, num_hidden_layers=2),
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
    "deepseek_v3": dict(
        model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2", num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1,
    ),
}
TINY_KINDS = tuple(_KINDS)


def tiny_config(kind: str = "llama", **overrides):
    fields = {**_COMMON, **_KINDS[kind], **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


_DEFAULT_ATTN = {"gemma2": "eager"}  # transformers has no sdpa path for Gemma-2 (soft-capping)


def tiny_model(kind: str = "llama", seed: int = 0, attn_implementation: str | None = None, **overrides):
    """A randomly initialised fp32 causal LM in eval mode (sdpa attention unless the model lacks it)."""
    attn_implementation = attn_implementation or _DEFAULT_ATTN.get(kind, "sdpa")
    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    return model.eval()


def randomized(module, seed: int, scale: float):
    """``module`` with every parameter drawn from N(0, scale^2) under ``seed``, in eval mode (draft heads whose
    trained-from-zero blocks would otherwise hide mistakes)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return module.eval()


def left_padded_batch(prompts: list[list[int]], pad_token_id: int = 0):
    """``(input_ids, attention_mask)`` [B, T_max] for token-id prompts of uneven length, left padded."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


# --- YaRN-scaled DeepSeek configs (attention tests: softmax scale includes mscale²) --------------------------------
# Not in TINY_KINDS on purpose: they repeat deepseek_v2/v3 with long-context RoPE. Values follow the released configs
# (V3: factor 40, mscale = mscale_all_dim = 1.0; V2-Lite: mscale = mscale_all_dim = 0.707).
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=128,
             beta_fast=32.0, beta_slow=1.0)
_KINDS["deepseek_v3_yarn"] = dict(
    _KINDS["deepseek_v3"], max_position_embeddings=5120,
    rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0),
)
_KINDS["deepseek_v2_yarn"] = dict(
    _KINDS["deepseek_v2"], max_position_embeddings=5120,
    rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707),
)


def char_tokenizer():
    """A byte-level character tokenizer over the tiny configs' 96 ids, so that tiny models can spell JSON:
    0/1/2 pad/bos/eos (the configs' ids), 3 the space, then printable ASCII except ``\\``` and ``~``; no merges.
    Byte-level, as llguidance (structured output) requires of a tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(33, 127) if chr(c) not in "`~"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "Ġ": 3, **{c: 4 + i for i, c in enumerate(chars)}}
    assert len(vocab) == 96
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
