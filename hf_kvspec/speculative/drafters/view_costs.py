"""What one forward reads, in bytes, when the target drafts for itself over a view of its own cache.

Boundary: arithmetic over a config, a batch size and column counts; no tensors are read, nothing is timed. Used
by ``SparseKVAssistant`` for its ``"auto"`` priors (the draft cost before a draft was timed, and whether to
start drafting at all) and by ``scripts/benchmark.py longctx`` to print the byte bound beside each measured ratio.

Model (MagicDec, Sadhukhan et al. 2408.11049, Sec. 3): decoding on a CPU or a GPU at small batch reads memory
more than it computes, so a forward costs about the bytes it reads:

    target step   W + m * B * S * b        W weight bytes, B rows, S cached columns, b K/V bytes per column and row
    draft step    W + B * (C + d) * b      C view columns (streaming: sinks + window), d draft tokens so far
    verify        ~ a target step          (the K + 1 queries share one read of the weights and of the K/V)

``m`` counts how often a step touches each cached K/V byte: 1 where the cache is written in place (StaticCache,
PagedCache), 3 for ``DynamicCache``, whose ``update`` concatenates every layer's whole history per forward
(read + write) besides attention reading it. A view pays where ``m * B * S * b`` outweighs ``W``: large batch x
long context, MagicDec's regime; at batch 1 the weights dominate both and a draft costs nearly a step.

The bound of a round drafting K tokens accepted with probability ``a`` each (Leviathan et al. 2211.17192):
``tau(K) / (1 + K * c_d)`` with ``tau(K) = (1 - a^(K+1)) / (1 - a)`` and ``c_d`` = draft step / target step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_kvspec.memory import kv_bytes_per_token


@dataclass(frozen=True)
class ViewBytes:
    """Bytes read per forward (module docstring): ``weights`` W, ``target_kv`` = B * S * b, ``view_kv`` = B * C * b,
    ``touches`` = m."""

    weights: int
    target_kv: int
    view_kv: int
    touches: int = 1

    @property
    def step(self) -> int:
        return self.weights + self.touches * self.target_kv

    @property
    def draft(self) -> int:
        return self.weights + self.view_kv

    @property
    def draft_ratio(self) -> float:
        """c_d: a draft step's bytes / a target step's."""
        return self.draft / self.step

    def bound(self, tokens_per_round: float, num_draft: float) -> float:
        """Speedup bound of rounds emitting ``tokens_per_round`` with ``num_draft`` drafts each, verify ~ a step."""
        return tokens_per_round / (1 + num_draft * self.draft_ratio)


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters (tied weights counted once: ``parameters()`` yields each tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def touches_per_step(cache) -> int:
    """m of the module docstring: 3 for a cache that concatenates its history per update (``DynamicCache``'s
    layers; also None, which generate makes a DynamicCache), 1 for caches written in place."""
    from transformers.cache_utils import DynamicLayer

    if cache is None:
        return 3
    layers = getattr(cache, "layers", None) or []
    return 3 if any(type(layer) is DynamicLayer for layer in layers) else 1


def view_bytes(config, weights: int, batch: int, context: int, view_columns: int, dtype: torch.dtype,
               touches: int = 1) -> ViewBytes:
    """``ViewBytes`` of a target of ``weights`` bytes with ``config``, ``batch`` rows of ``context`` cached columns
    in ``dtype``, and a view of ``view_columns`` columns (fewer when the context is shorter)."""
    per_column = kv_bytes_per_token(config, dtype) * batch
    return ViewBytes(weights, per_column * context, per_column * min(view_columns, context), touches)
