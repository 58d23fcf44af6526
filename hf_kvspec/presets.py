"""Named model configs for memory arithmetic, so ``hf-kvspec memory llama-3-70b`` needs no Hub access.

Boundary: shapes only, copied from the models' published ``config.json`` files; no weights.
"""

from __future__ import annotations

import json
from pathlib import Path

PRESETS: dict[str, dict] = {
    "llama-3-70b": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
    ),
    "llama-2-7b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    ),
    "deepseek-v2": dict(
        model_type="deepseek_v2", hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400,
        n_routed_experts=160, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}


def load_config(spec: str):
    """A transformers config from a preset name, a ``config.json`` path or a local model directory."""
    from transformers import AutoConfig

    if spec in PRESETS:
        fields = dict(PRESETS[spec])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _config_from_json(path)
    names = ", ".join(PRESETS)
    raise ValueError(f"{spec!r} is not a preset ({names}), a config.json file or a model directory.")


def _config_from_json(path: Path):
    """A config from a ``config.json``; every failure names the file."""
    from transformers import AutoConfig

    try:
        fields = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); point at a transformers config.json.") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"{path} has no 'model_type'; is it a transformers config.json?")
    try:
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{path}: transformers cannot build a config from it ({err}).") from None
