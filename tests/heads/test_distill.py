"""Self-distillation: the target's greedy answers, generated in batches, read back from the disk cache."""

from __future__ import annotations

import torch

from hf_kvspec.heads.distill import DistillSettings, chat_prompt_ids, self_distill
from tests.heads.tiny_base import char_tokenizer
from tests.tiny_models import tiny_model


def test_responses_are_greedy_and_cached(tmp_path):
    tokenizer = char_tokenizer()
    model = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    prompts = ["count to three", "hi", "name a colour please"]
    settings = DistillSettings(max_new_tokens=6, batch_size=2)
    convs = self_distill(model, tokenizer, prompts, tmp_path / "d.jsonl", "fp", settings, progress=False)
    for prompt, conv in zip(prompts, convs):
        assert conv.prompt_ids == chat_prompt_ids(tokenizer, prompt)
        ids = torch.tensor([conv.prompt_ids])
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                   pad_token_id=0)[0, ids.shape[1]:].tolist()
        # batched (left-padded) greedy equals unbatched greedy, cut after EOS
        cut = next((i + 1 for i, t in enumerate(reference) if t == tokenizer.eos_token_id), len(reference))
        assert conv.response_ids == reference[:cut]
    calls = []
    model.generate = lambda *a, **k: calls.append(1)  # a cache hit must not generate again
    again = self_distill(model, tokenizer, prompts, tmp_path / "d.jsonl", "fp", settings, progress=False)
    assert again == convs and not calls
