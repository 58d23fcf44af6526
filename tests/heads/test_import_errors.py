"""Malformed serving-layout directories, heads exported for another vocabulary, and ``export-heads`` CLI errors:
each refused with ``HeadImportError`` / ``hf-kvspec: error:`` naming the file or flag and the fix."""

from __future__ import annotations

import json
import re

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file, save_file

from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.export import export_head
from hf_kvspec.heads.import_formats import HeadImportError, import_head
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama", seed=0, num_hidden_layers=5)


def _eagle3(base, draft_vocab=True):
    config = EagleConfig.for_base_model(base, "tiny", feature_layers=[1, 2, 3], architecture="eagle3",
                                        draft_vocab_size=40 if draft_vocab else None)
    head = EagleHead(config).attach(base).eval()
    if draft_vocab:
        head.set_draft_vocab(torch.arange(40) * 2)
    return head


def _medusa(base, **kwargs):
    return MedusaHeads(MedusaConfig.for_base_model(base, "tiny", num_heads=2, num_layers=1, **kwargs)).attach(base)


def _edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _drop_tensor(path, name):
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("spoil,words", [
    (lambda p: (p / "config.json").unlink(), r"config\.json.*not found"),
    (lambda p: (p / "config.json").write_text("{not json"), r"config\.json is not valid JSON"),
    (lambda p: (p / "config.json").write_text("[1, 2]"), r"config\.json holds a list"),
    (lambda p: _edit_config(p, lambda c: c.pop("transformer_layer_config")), "transformer_layer_config"),
    (lambda p: _drop_tensor(p, "fc.weight"), r"fc\.weight"),
    (lambda p: (p / "model.safetensors").write_bytes(b"garbage"), r"model\.safetensors"),
])
def test_malformed_speculators_directory_names_the_file_and_field(base, tmp_path, spoil, words):
    export_head(_eagle3(base), "speculators", tmp_path)
    spoil(tmp_path)
    with pytest.raises(HeadImportError, match=words):
        import_head(tmp_path, base)


@pytest.mark.parametrize("spoil,words", [
    (lambda p: _edit_config(p, lambda c: c.pop("num_heads")), "num_heads"),
    (lambda p: _edit_config(p, lambda c: c.update(num_heads="two")), "num_heads"),
    (lambda p: _drop_tensor(p, "lm_heads.0.weight"), r"lm_heads\.0\.weight"),
    (lambda p: _drop_tensor(p, "blocks.0.layers.0.weight"), r"blocks\.0\.layers\.0\.weight"),
    (lambda p: _edit_config(p, lambda c: c.update(num_hidden_layers=0)), "num_hidden_layers=0"),
])
def test_malformed_medusa_directory_names_the_field(base, tmp_path, spoil, words):
    export_head(_medusa(base), "vllm-medusa", tmp_path)
    spoil(tmp_path)
    with pytest.raises(HeadImportError, match=words):
        import_head(tmp_path, base)


def test_a_missing_directory_is_named(base, tmp_path):
    with pytest.raises(HeadImportError, match="is not a directory"):
        import_head(tmp_path / "nowhere", base)


@pytest.mark.parametrize("draft_vocab", [True, False], ids=["draft-vocab", "full-vocab"])
def test_an_export_for_another_vocabulary_is_refused(base, tmp_path, draft_vocab):
    """A head exported against a 96-token base imported onto a 120-token one: its d2t/t2d (or its LM head)
    describe another vocabulary and must not be accepted."""
    export_head(_eagle3(base, draft_vocab), "speculators", tmp_path)
    other = tiny_model("llama", seed=0, num_hidden_layers=5, vocab_size=120)
    with pytest.raises(HeadImportError, match=r"vocabulary of 96.*120"):
        import_head(tmp_path, other)


def test_medusa_export_for_another_vocabulary_is_refused(base, tmp_path):
    export_head(_medusa(base), "vllm-medusa", tmp_path)
    other = tiny_model("llama", seed=0, num_hidden_layers=5, vocab_size=120)
    with pytest.raises(HeadImportError, match=r"vocabulary of 96.*120"):
        import_head(tmp_path, other)


def test_medusa_config_refuses_zero_layers(base):
    """A head without blocks has no parameters of its own (it used to fail with StopIteration mid-generation)."""
    with pytest.raises(StrictDataclassClassValidationError, match=r"num_layers=0.*at least 1"):
        MedusaConfig.for_base_model(base, "tiny", num_layers=0)
    with pytest.raises(StrictDataclassClassValidationError, match=r"num_heads=0.*at least 1"):
        MedusaConfig.for_base_model(base, "tiny", num_heads=0)


@pytest.fixture(scope="module")
def saved_head(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base.save_pretrained(root / "base")
    MedusaHeads(MedusaConfig.for_base_model(base, str(root / "base"), num_heads=2)).save_pretrained(root / "head")
    return root


@pytest.mark.parametrize("args,words", [
    (lambda r: [str(r / "missing"), "--out", str(r / "o1")], "is not a directory"),
    (lambda r: [str(r), "--out", str(r / "o2")], "holds no config.json"),
    (lambda r: [str(r / "head"), "--out", str(r / "o3"), "--base_model", str(r / "nope")], "--base_model"),
    (lambda r: [str(r / "head"), "--out", str(r / "head" / "config.json")], "--out .* is a file"),
    (lambda r: ["bundled:hydra", "--out", str(r / "o4")], "kind must be one of .*'eagle'"),
])
def test_cli_export_heads_errors_are_one_line(saved_head, capsys, args, words):
    from hf_kvspec.cli import main

    assert main(["export-heads", "--format", "vllm-medusa", *args(saved_head)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-kvspec: error: ") and "Traceback" not in err
    assert re.search(words, err), err
