"""A bigram language model that is a real ``PreTrainedModel`` + ``GenerationMixin``, for statistical tests.

Its logits at a position are ``table[token]``, so a forward over 100k rows costs an embedding lookup, while
``generate``, its logits processors (path-dependent ones see the whole prefix), the caller's cache (one
``DynamicCache`` layer, cropped like any other) and the speculative loop all run exactly as for a transformer.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class MarkovConfig(PretrainedConfig):
    model_type = "hf_kvspec_test_markov"

    def __init__(self, vocab_size: int = 8, sharpness: float = 2.0, **kwargs):
        self.vocab_size = vocab_size
        self.sharpness = sharpness
        self.num_hidden_layers = 1
        super().__init__(**kwargs)


class MarkovLM(PreTrainedModel, GenerationMixin):
    config_class = MarkovConfig
    _supports_cache_class = True

    def __init__(self, config: MarkovConfig):
        super().__init__(config)
        self.lm_head = nn.Linear(config.vocab_size, config.vocab_size, bias=False)  # row x of weight.T = logits

    def _init_weights(self, module):
        pass

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0, output_hidden_states=False, **kwargs):
        if use_cache:
            cache = cache if cache is not None else DynamicCache()
            slots = input_ids.new_zeros(input_ids.shape[0], 1, input_ids.shape[1], 1, dtype=torch.float32)
            cache.update(slots, slots, 0)  # one token slot per input token, so cropping is real
        logits = nn.functional.embedding(input_ids, self.lm_head.weight.T)  # [B, T, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        hidden = (logits,) if output_hidden_states else None
        return CausalLMOutputWithPast(logits=logits, cache=cache if use_cache else None, hidden_states=hidden)


def markov_pair(vocab_size: int = 8, seed: int = 0, sharpness: float = 2.0):
    """``(target, draft)``: a random bigram table and a noisy copy of it (so acceptance is partial)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab_size, vocab_size, generator=gen) * sharpness
    noise = torch.randn(vocab_size, vocab_size, generator=gen) * sharpness  # draft = related but different
    models = []
    for weight in (table, table + noise):
        model = MarkovLM(MarkovConfig(vocab_size=vocab_size, sharpness=sharpness, pad_token_id=0))
        with torch.no_grad():
            model.lm_head.weight.copy_(weight)
        models.append(model.eval())
    return tuple(models)
