"""scripts/train_drafter.py --head early_exit under a real ``accelerate launch`` on a tiny random base model: the loss
falls, the saved adapter reloads exactly, the summary holds the held-out numbers and the card renders them."""

from __future__ import annotations

import itertools
import json
import math

import torch
from safetensors.torch import load_file

from hf_kvspec.heads.modeling_exit import ExitAdapter
from tests.heads.tiny_base import save_tiny_base, write_tiny_corpus
from tests.test_train_drafter import _launch


def test_accelerate_launch_trains_an_exit_adapter(tmp_path):
    save_tiny_base(tmp_path / "base")
    write_tiny_corpus(tmp_path / "corpus.txt")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("say one", "count")))
    out = tmp_path / "out"
    run = _launch(["--head", "early_exit", "--exit_layer", "1", "--base_model", str(tmp_path / "base"),
                   "--dataset", str(tmp_path / "corpus.txt"), "--cache_features", "true",
                   "--data_cache_dir", str(tmp_path / "cache"), "--eval_prompts", str(tmp_path / "prompts.jsonl"),
                   "--self_distill", "true", "--distill_max_new_tokens", "8", "--max_steps", "12",
                   "--per_device_batch_size", "4", "--learning_rate", "1e-2", "--warmup_steps", "2",
                   "--logging_steps", "4", "--save_steps", "12", "--num_threads", "1", "--output_dir", str(out)])
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(map(math.isfinite, losses)), losses
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses

    adapter = ExitAdapter.from_pretrained(out)
    assert adapter.config.exit_layer == 1 and adapter.config.base_num_layers == 2
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == adapter.state_dict().keys()
    assert all(torch.equal(saved[k], adapter.state_dict()[k]) for k in saved)
    assert adapter.down_proj.weight.abs().sum() > 0  # trained away from the identity it starts as

    summary = json.loads((out / "training_summary.json").read_text())
    held_out = summary["held_out"]
    assert held_out["prompts"] == 2 and len(held_out["per_head_top1"]) == 4
    card = (out / "README.md").read_text()
    assert "Early-exit adapter" in card and f"τ = {held_out['tau']:.2f}" in card and "exit layer E | 1" in card
