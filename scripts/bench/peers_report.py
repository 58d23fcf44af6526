"""The pure half of ``benchmark.py peers``: greedy agreement between answers, and the table's rows.

Boundary: lists of ``Generation`` in, dicts out; no processes, no models, no clocks.

Terms:
    reference   ours/plain's answer to the same prompt in the same repeat (plain greedy ``generate``)
    agree       the fraction of the reference's tokens that a method reproduced before its first differing
                token (summed over prompts); a later match after a divergence is not counted (the texts are
                shifted by then)
    identical   answers equal to the reference token for token, ending the same way (EOS or the limit)
"""

from __future__ import annotations

import statistics

from bench.peer_client import Generation

REFERENCE = "ours/plain"
LLAMA_CPP = "llama.cpp"  # the peer every row is also compared with
COLUMNS = ["prompts", "method", "tokens", "tok_per_s", "ttft_ms", "vs_llama_cpp", "vs_ours_plain", "agree",
           "identical"]


def split_at_eos(new_tokens: list[int], eos: list[int]) -> tuple[list[int], bool]:
    """(the tokens before the first EOS id, whether there was one)."""
    for index, token in enumerate(new_tokens):
        if token in eos:
            return new_tokens[:index], True
    return list(new_tokens), False


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def agreement(reference: list[Generation], other: list[Generation]) -> tuple[float, int]:
    """(agree, identical) of ``other`` against ``reference``, answer i against answer i (module docstring)."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference answers but {len(other)} to compare")
    matched = sum(common_prefix(r.tokens, o.tokens) for r, o in zip(reference, other))
    total = sum(len(r.tokens) for r in reference)
    identical = sum(r.tokens == o.tokens and r.eos == o.eos for r, o in zip(reference, other))
    return (matched / total if total else 1.0), identical


def speed(answers: list[Generation]) -> float:
    """Tokens per second end to end: generated tokens (EOS included) / the calls' wall seconds."""
    return sum(a.count for a in answers) / sum(a.seconds for a in answers)


def rows(prompt_set: str, results: dict[str, list[Generation]]) -> list[dict]:
    """One row per method of one prompt set; ``results[method]`` lists its answers in the same prompt order for
    every method. Ratios are against llama.cpp and ours/plain of the same results (absent ones: "-")."""
    speeds = {method: speed(answers) for method, answers in results.items()}
    out = []
    for method, answers in results.items():
        row = {"prompts": prompt_set, "method": method, "tokens": sum(a.count for a in answers),
               "tok_per_s": round(speeds[method], 2),
               "ttft_ms": round(statistics.median(a.ttft_s for a in answers) * 1e3, 1),
               "vs_llama_cpp": _ratio(speeds, method, LLAMA_CPP), "vs_ours_plain": _ratio(speeds, method, REFERENCE),
               "agree": "-", "identical": "-"}
        if REFERENCE in results:
            agree, identical = agreement(results[REFERENCE], answers)
            row |= {"agree": round(agree, 3), "identical": f"{identical}/{len(answers)}"}
        out.append(row)
    return out


def _ratio(speeds: dict[str, float], method: str, baseline: str) -> float | str:
    return round(speeds[method] / speeds[baseline], 3) if baseline in speeds else "-"
