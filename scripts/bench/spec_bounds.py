"""The arithmetic of ``spec --assistant``: cost tables, the speedup bound, and one row per (batch, mode, method).

Boundary: pure Python over numbers and the samples ``spec_trees.py`` collected (seconds, sequences, the loop's
``AcceptanceStats``); no model. ``scripts/measure_tree_choices.py`` uses the same cost-table helpers.

The bound: a round that verifies N nodes costs one target forward over N + 1 tokens, ``c_v(N + 1)`` one-token
forwards, plus the drafting; it emits tau tokens where plain decoding emits one per one-token forward. So no loop
can beat ``tau / (c_v(N + 1) + draft)`` times plain, and ``speed_vs_plain / bound`` is the share the loop keeps (the
rest is its own overhead: Python, logits processing, cache compaction, verification). Prefill is left out of both.
For bs=B rows, forwards scale with the tokens of all rows: ``c_v(B (N + 1)) / c_v(B)`` against one bs=B step
(an approximation; the table is measured at bs=1).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Mapping

import torch

COST_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96, 128)
COLUMNS = ["batch", "mode", "method", "prompts", "nodes", "tau", "accept_by_depth", "c_v", "draft_steps", "bound",
           "speed_vs_plain", "speed_over_bound", "tokens_per_s", "equals_plain"]



@torch.inference_mode()
def forward_costs(model, context: int, low: int = 100, high: int = 10_000) -> dict[int, float]:
    """Seconds of one target forward over T new tokens (T in ``COST_TOKENS``, random ids in ``low..high - 1``) after
    a warm cache of ``context`` tokens; the T tokens are cropped again after each forward."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(torch.randint(low, high, (1, context)), cache=cache, use_cache=True)
    seconds = {}
    for tokens in COST_TOKENS:
        ids = torch.randint(low, high, (1, tokens))
        start = time.perf_counter()
        model(ids, cache=cache, use_cache=True, logits_to_keep=tokens,
              position_ids=torch.arange(context, context + tokens)[None])
        seconds[tokens] = time.perf_counter() - start
        cache.crop(-tokens)
    return seconds


def monotone(table: Mapping[int, float]) -> dict[int, float]:
    """Least-squares non-decreasing fit of ``{T: c_v(T)}`` (pool-adjacent-violators): more tokens never cost
    less, so a dip between neighbours is timing noise on a shared machine, not physics."""
    blocks: list[list[float]] = []  # [sum, count] per pooled block, in T order
    for key in sorted(table):
        blocks.append([table[key], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [value / count for value, count in blocks for _ in range(count)]
    return {key: round(value, 3) for key, value in zip(sorted(table), fitted)}


def interpolate(table: Mapping[int, float], x: float) -> float:
    """Linear interpolation of a measured ``{T: c_v(T)}`` table (clamped at its ends)."""
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    for low, high in itertools.pairwise(keys):
        if x <= high:
            return table[low] + (table[high] - table[low]) * (x - low) / (high - low)
    return table[keys[-1]]


def speedup_bound(tau: float, nodes_per_round: list[int], draft_s_per_round: float, step_s: float,
                  cost_v: Mapping[int, float], batch: int = 1) -> tuple[float, float, float]:
    """``(bound, mean c_v(N + 1), draft in target steps)`` for rounds that verified ``nodes_per_round`` nodes."""
    base = interpolate(cost_v, batch)
    verify = statistics.mean(interpolate(cost_v, batch * (n + 1)) / base for n in nodes_per_round)
    draft = draft_s_per_round / (step_s * base)
    return tau / (verify + draft), verify, draft


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos_id: int | None) -> int:
    """Real new tokens: up to and including each row's first EOS."""
    total = 0
    for row in sequences[:, prompt_len:].tolist():
        total += row.index(eos_id) + 1 if eos_id in row else len(row)
    return total


def per_depth(stats_list) -> list[float]:
    """Acceptance per draft position (per depth for trees), pooled over calls; trailing never-offered ones cut."""
    width = max((len(s.drafted) for s in stats_list), default=0)
    drafted, accepted = [0] * width, [0] * width
    for stats in stats_list:
        for j, (d, a) in enumerate(zip(stats.drafted, stats.accepted)):
            drafted[j], accepted[j] = drafted[j] + d, accepted[j] + a
    while drafted and drafted[-1] == 0:
        drafted.pop()
    return [round(a / d, 3) if d else 0.0 for a, d in zip(accepted, drafted)]


def _median(samples: list[dict]) -> dict:
    return sorted(samples, key=lambda s: s["seconds"])[len(samples) // 2]


def method_row(batch: int, mode: str, method: str, picked: list[dict], plain_rate: float, equal: bool | str,
               cost_v: Mapping[int, float], step_s: float, eos_id: int | None) -> dict:
    """One table row from the median sample of each prompt (``picked``)."""
    tokens = sum(new_tokens(s["sequences"], s["prompt_len"], eos_id) for s in picked)
    rate = tokens / sum(s["seconds"] for s in picked)
    row = {"batch": batch, "mode": mode, "method": method, "prompts": len(picked), "tokens_per_s": round(rate, 2),
           "speed_vs_plain": round(rate / plain_rate, 3), "equals_plain": equal}
    stats = [s["stats"] for s in picked if s["stats"] is not None]
    if not stats:  # plain generate: one token per row per forward, by definition the bound's unit
        return row | {"nodes": 0, "tau": 1.0, "accept_by_depth": "", "c_v": 1.0, "draft_steps": 0.0, "bound": 1.0,
                      "speed_over_bound": round(rate / plain_rate, 3)}
    tau = sum(s.emitted_tokens for s in stats) / sum(s.row_rounds for s in stats)
    lengths = [n for s in stats for n in s.draft_lengths]
    draft_s = sum(s.draft_time_s for s in stats) / sum(s.rounds for s in stats)
    bound, verify, draft = speedup_bound(tau, lengths, draft_s, step_s, cost_v, batch)
    return row | {"nodes": round(statistics.mean(lengths), 1), "tau": round(tau, 3),
                  "accept_by_depth": per_depth(stats), "c_v": round(verify, 2), "draft_steps": round(draft, 2),
                  "bound": round(bound, 3), "speed_over_bound": round(rate / plain_rate / bound, 3)}


def aggregate_rows(samples: dict, methods: list[str], cost_v: Mapping[int, float], step_s: float,
                   eos_id: int | None) -> list[dict]:
    """``samples`` {(batch, mode, prompt index): {method: [sample per repeat]}} -> rows per (batch, mode, method).
    Greedy rows check every repeat of every prompt against plain's output (token-identical, or how many differ)."""
    rows = []
    for batch, mode in dict.fromkeys((b, m) for b, m, _ in samples):
        keys = [k for k in samples if k[:2] == (batch, mode)]
        picked = {m: [_median(samples[k][m]) for k in keys] for m in methods}
        plain = picked["plain"]
        plain_rate = sum(new_tokens(s["sequences"], s["prompt_len"], eos_id) for s in plain) / sum(
            s["seconds"] for s in plain)
        for method in methods:
            equal = ""
            if mode == "greedy":
                differ = sum(not torch.equal(s["sequences"], samples[k]["plain"][0]["sequences"])
                             for k in keys for s in samples[k][method])
                equal = True if differ == 0 else f"{differ} runs differ"
            rows.append(method_row(batch, mode, method, picked[method], plain_rate, equal, cost_v, step_s, eos_id))
    return rows


def target_checks(rows: list[dict]) -> list[str]:
    """The issue's targets, read off the rows (bs=1 greedy unless named)."""
    def get(batch, mode, prefix):
        return [r for r in rows if r["batch"] == batch and r["mode"] == mode and r["method"].startswith(prefix)]

    notes = []
    greedy = {r["method"]: r for r in get(1, "greedy", "")}
    chains = [r for m, r in greedy.items() if m.endswith(":chain") or ":chain:" in m]
    trees = [r for m, r in greedy.items() if r not in chains and m != "plain"]
    for chain in chains:
        family = chain["method"].split(":")[0]
        best = max((r for r in trees if r["method"].startswith(family)), key=lambda r: r["tau"], default=None)
        if best:
            notes.append(f"target tau: {best['method']} tau {best['tau']} = {best['tau'] / chain['tau']:.2f}x "
                         f"{chain['method']} tau {chain['tau']} (bs=1 greedy).")
    sampled = {r["method"]: r for r in get(1, "t=0.7", "")}
    for method, row in sampled.items():
        if method != "plain" and method in greedy:
            notes.append(f"target t=0.7: {method} keeps {row['tau'] / greedy[method]['tau']:.0%} of its greedy tau.")
    timed = [r for r in rows if r["method"] != "plain"]
    if timed:
        worst = min(timed, key=lambda r: r["speed_over_bound"])
        best = max((r for r in timed if r["batch"] == 1), key=lambda r: r["speed_vs_plain"], default=worst)
        notes.append(f"target speed/bound: lowest {worst['speed_over_bound']} ({worst['method']}, bs={worst['batch']}, "
                     f"{worst['mode']}); best bs=1 configuration {best['method']} ({best['mode']}): "
                     f"{best['speed_vs_plain']}x plain.")
    notes += [f"target bs=4: {r['method']} {r['speed_vs_plain']}x plain bs=4." for r in get(4, "greedy", "")
              if r["method"] != "plain"]
    unequal = [f"{r['method']} bs={r['batch']}" for r in rows if r["equals_plain"] not in (True, "")]
    notes.append("greedy outputs identical to plain in every cell." if not unequal
                 else f"greedy outputs NOT identical to plain: {unequal}.")
    return notes


def bound_notes(rows: list[dict], cost_v: Mapping[int, float], step_s: float, load_before: str,
                load_after: str) -> list[str]:
    return [
        "Timing: torch.set_num_threads(1) on a 2-core machine shared with other engineers' test runs "
        f"(load average 1/5/15 min before: {load_before}; after: {load_after}). Every repeat times the forward "
        "costs, then runs every method once per prompt, the order rotated per prompt and repeat; per prompt the "
        "median repeat; tokens_per_s = all prompts' new tokens / their summed seconds.",
        f"One-token target forward (warm cache, median): {step_s * 1e3:.1f} ms. c_v(T) (non-decreasing fit of the "
        f"medians): {', '.join(f'{t}: {v:.2f}' for t, v in cost_v.items())}.",
        "tau = tokens emitted per row per verify round (prefill excluded); accept_by_depth[j] = accepted / offered at "
        "draft position j (depth j + 1 of a tree); nodes = mean nodes verified per round; c_v = mean c_v(N + 1) over "
        "the rounds; draft_steps = drafting seconds per round / one-token forward; bound = tau / (c_v + draft_steps); "
        "speed_over_bound = speed_vs_plain / bound (1.0 = the loop costs nothing beyond the forwards).",
        *target_checks(rows),
    ]
