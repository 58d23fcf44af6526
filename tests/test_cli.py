"""The ``hf-kvspec`` command line: memory arithmetic and generation on the bundled model."""

from __future__ import annotations

import json

from hf_kvspec.cli import main


def test_memory_llama3_70b(capsys):
    assert main(["memory", "llama-3-70b", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "per sequence: 1.25 GiB (1,342,177,280 B)" in out
    assert "per token:    320.00 KiB" in out


def test_memory_budget_and_batch(capsys):
    assert main(["memory", "llama-2-7b", "--seq-len", "4096", "--batch", "4", "--budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "total:        8.00 GiB" in out
    assert "max batch 33" in out  # (80 GiB - 12.55 GiB of fp16 weights) / 2 GiB per sequence


def test_memory_quantized(capsys):
    assert main(["memory", "llama-2-7b", "--seq-len", "4096", "--bits", "4", "--group-size", "64"]) == 0
    assert "per sequence: 576.00 MiB" in capsys.readouterr().out  # 2 GiB · 4.5/16


def test_memory_from_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}))
    assert main(["memory", str(tmp_path), "--seq-len", "10", "--dtype", "fp32"]) == 0
    assert "(5,120 B)" in capsys.readouterr().out  # 2 (K,V)·2 layers·2 heads·16 dim·4 B·10 tokens


def test_memory_unknown_config_is_a_clear_error(capsys):
    assert main(["memory", "no-such-model"]) == 2
    assert "is not a preset" in capsys.readouterr().err


def test_generate_streams_and_prints_stats(bundled, capsys):
    assert main(["generate", "Name a primary color.", "--max-new-tokens", "8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("tokens/s", "tokens per target forward", "KV bytes (dynamic)"):
        assert row in out
