"""``evaluate`` metric: how far a lossy KV cache (KIVI, int8, fp8, ...) moves a model from its full-precision self.

Boundary: per-token numbers in, aggregates out; ``token_statistics`` turns two runs' logits into those per-token
numbers. Running the model through a cache is the caller's business (``scripts/bench/kvquant.py`` does it). Imports
nothing from hf_kvspec: ``evaluate.load`` copies this file into its own module cache and imports the copy.

Why per-token inputs, not logits: ``evaluate`` stores every example in Arrow (on disk, and gathered across processes
in distributed evaluation). A token's logits are V floats (49,152 for SmolLM2: 192 KiB in fp32), the four numbers
below are 25 bytes, and every figure this metric reports is a mean (or max) over tokens of one of them, so reducing
each token first loses nothing. One example is one predicted token:

    logprob              log p_cache(label): the label's log-probability through the lossy cache
    reference_logprob    log p_full(label): the same, through the full-precision cache
    kl                   KL(p_full || p_cache) of the two next-token distributions, in nats (the reference comes
                         first: the divergence weights errors by where the full-precision model puts its mass)
    top1_match           argmax p_cache == argmax p_full

Results: ``perplexity`` = exp(-mean logprob), ``reference_perplexity``, ``delta_perplexity_percent`` = 100 (ppl /
reference ppl - 1), ``kl_divergence`` (mean), ``kl_divergence_max``, ``top1_agreement`` (mean), ``tokens``.
Papers: KIVI (Liu et al., arXiv 2402.02750) reports perplexity through the cache; KVQuant (Hooper et al., arXiv
2401.18079) too. The KL and top-1 columns are the usual quantization-fidelity companions of perplexity.
"""

from __future__ import annotations

import math

import datasets
import evaluate
import torch

_DESCRIPTION = """Fidelity of a lossy KV cache: perplexity through the cache vs full precision, mean and max KL
divergence KL(full || cache) of next-token distributions, and top-1 agreement. One example is one predicted token,
described by four numbers that `token_statistics(logits, reference_logits, labels)` computes from the two runs'
logits; logits themselves are never stored."""

_KWARGS_DESCRIPTION = """
Args:
    logprob: per token, log-probability of the label through the lossy cache.
    reference_logprob: per token, log-probability of the label at full precision.
    kl: per token, KL(full || cache) in nats.
    top1_match: per token, whether both runs' argmax agree.
Returns:
    perplexity, reference_perplexity, delta_perplexity_percent, kl_divergence, kl_divergence_max, top1_agreement,
    tokens.
Examples:
    >>> metric = hf_kvspec.load_metric("cache_fidelity")
    >>> logits = torch.randn(1, 5, 10); labels = torch.randint(0, 10, (1, 5))
    >>> metric.compute(**token_statistics(logits, logits, labels))["kl_divergence"]
    0.0
"""

_CITATION = """@inproceedings{liu2024kivi,
  title = {{KIVI}: A Tuning-Free Asymmetric 2bit Quantization for {KV} Cache},
  author = {Liu, Zirui and Yuan, Jiayi and Jin, Hongye and Zhong, Shaochen and Xu, Zhaozhuo and Braverman, Vladimir and
            Chen, Beidi and Hu, Xia},
  booktitle = {International Conference on Machine Learning},
  year = {2024},
  note = {arXiv:2402.02750}
}
"""

IGNORE_INDEX = -100  # labels equal to this are not scored (the transformers convention for padding / prompts)


class CacheFidelity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        if self.config_name != "default":
            raise ValueError(f"cache_fidelity has one configuration; drop config_name={self.config_name!r}.")
        number = datasets.Value("float64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"logprob": number, "reference_logprob": number, "kl": number,
                                        "top1_match": datasets.Value("bool")}),
            reference_urls=["https://arxiv.org/abs/2402.02750", "https://arxiv.org/abs/2401.18079"])

    def _compute(self, logprob, reference_logprob, kl, top1_match) -> dict:
        return fidelity(logprob, reference_logprob, kl, top1_match)


def fidelity(logprob: list, reference_logprob: list, kl: list, top1_match: list) -> dict:
    """The metric's result from per-token lists (sums in float64: tens of thousands of tokens stay exact enough)."""
    tokens = len(logprob)
    if not tokens:
        raise ValueError("cache_fidelity got no tokens: add_batch(**token_statistics(...)) before compute().")
    for name, values in (("logprob", logprob), ("reference_logprob", reference_logprob), ("kl", kl)):
        bad = next((i for i, v in enumerate(values) if math.isnan(v)), None)
        if bad is not None:
            raise ValueError(f"{name} holds NaN at token {bad}: the run that produced it went non-finite; "
                             "token_statistics refuses such logits and says where.")
    perplexity = math.exp(-math.fsum(logprob) / tokens)
    reference = math.exp(-math.fsum(reference_logprob) / tokens)
    return {"perplexity": perplexity, "reference_perplexity": reference,
            "delta_perplexity_percent": 100 * (perplexity / reference - 1),
            "kl_divergence": math.fsum(kl) / tokens, "kl_divergence_max": max(kl),
            "top1_agreement": sum(map(bool, top1_match)) / tokens, "tokens": tokens}


# Shapes: B batch, T positions, V vocabulary.
@torch.no_grad()
def token_statistics(logits: torch.Tensor, reference_logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """The metric's per-token inputs from two runs over the same tokens (fp32 math, whatever the logits' dtype).

    logits [B, T, V] through the lossy cache; reference_logits [B, T, V] at full precision; labels [B, T] the token
    each position predicts (already shifted; ``IGNORE_INDEX`` skips a position). Returns lists of the scored tokens.
    """
    _check_label_ids(logits, reference_logits, labels)
    if logits.shape != reference_logits.shape or logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, reference_logits {tuple(reference_logits.shape)} and labels "
                         f"{tuple(labels.shape)} must cover the same [B, T] positions (labels shifted to match).")
    keep = labels != IGNORE_INDEX                                                         # [B, T]
    _check_finite(logits, keep, "logits")
    _check_finite(reference_logits, keep, "reference_logits")
    log_probs = torch.log_softmax(logits[keep].float(), dim=-1)                           # [N, V]
    reference = torch.log_softmax(reference_logits[keep].float(), dim=-1)                 # [N, V]
    targets = labels[keep][:, None]                                                       # [N, 1]
    gap = torch.where(reference.isneginf(), 0.0, reference - log_probs)                   # [N, V]; 0 * log 0 = 0
    kl = torch.einsum("nv,nv->n", reference.exp(), gap).clamp(min=0)                      # [N]; rounding can dip < 0
    return {"logprob": log_probs.gather(-1, targets)[:, 0].tolist(),
            "reference_logprob": reference.gather(-1, targets)[:, 0].tolist(), "kl": kl.tolist(),
            "top1_match": (log_probs.argmax(-1) == reference.argmax(-1)).tolist()}


def _check_label_ids(logits, reference_logits, labels) -> None:
    """Refuse what ``gather`` would fail on deep inside: non-tensors, float labels, ids outside the vocabulary."""
    if not all(isinstance(x, torch.Tensor) for x in (logits, reference_logits, labels)):
        raise TypeError("token_statistics takes tensors: logits [B, T, V], reference_logits [B, T, V], labels [B, T].")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}.")
    scored = labels[labels != IGNORE_INDEX]
    vocab = logits.shape[-1]
    if scored.numel() and (scored.min() < 0 or scored.max() >= vocab):
        raise ValueError(f"labels must be token ids in 0..{vocab - 1} (or {IGNORE_INDEX} to skip a position), got "
                         f"values in {int(scored.min())}..{int(scored.max())}.")


def _check_finite(logits: torch.Tensor, keep: torch.Tensor, name: str) -> None:
    """Refuse NaN / +inf logits and rows masked entirely (-inf everywhere) at scored positions: they would turn
    perplexity and KL into NaN. -inf entries are fine (a processor masking part of the vocabulary)."""
    broken = (logits.isnan() | logits.isposinf()).any(-1) & keep                         # [B, T]
    if broken.any():
        where = broken.nonzero()[0].tolist()
        raise ValueError(f"{name} hold NaN or +inf at {where} (batch, position) among {int(broken.sum())} scored "
                         "positions: the run went non-finite (overflowing dtype or cache); fix that run first.")
    empty = logits.isneginf().all(-1) & keep                                             # [B, T]
    if empty.any():
        raise ValueError(f"{name} give no distribution at {empty.nonzero()[0].tolist()} (batch, position): every "
                         f"entry is -inf; pass {IGNORE_INDEX} as that position's label to skip it.")
