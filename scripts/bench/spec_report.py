"""Rows, headline ratios, merging and the plot of ``scripts/benchmark.py spec`` (the measuring is in ``spec.py``)."""

from __future__ import annotations

import json
import statistics

import torch

from bench.harness import RESULTS_DIR, Report, save_plot

#: ours as shipped (decode_kernels=False, torch's stock kernels) and ours with the opt-in decode kernels (+kernels)
METHODS = ("plain", "ours/draft", "hf/draft", "ours/draft-auto", "ours/ngram", "hf/ngram",
           "ours/draft+kernels", "ours/ngram+kernels")
#: transparency variants: the other loops inside hf_kvspec.DecodeKernels(target, draft) (hf_kvspec/kernels/)
KERNEL_VARIANTS = ("hf/draft+kernels", "hf/ngram+kernels", "plain+kernels")
#: settings key that marks a part measured with the kernels off by default (parts without it are older)
STOCK_DEFAULT_KEY = "ours_default"
STOCK_DEFAULT = "decode_kernels=False; +kernels rows: decode_kernels=True"
COLUMNS = ["batch", "mode", "draft", "prompt", "method", "new_tokens", "seconds", "tokens_per_s", "tau",
           "draft_fwd_per_target_fwd", "loop_ms_per_target_fwd", "speed_vs_plain", "speed_vs_hf_same_drafter",
           "equals_plain"]
TITLE = "Speculative decoding on SmolLM2-135M (CPU): tau and speed vs plain and vs transformers"
#: (ours, theirs) pairs summarised in the headlines, when both ran
HEADLINE_PAIRS = (("ours/draft", "hf/draft"), ("ours/draft-auto", "hf/draft"), ("ours/ngram", "hf/ngram"),
                  ("ours/draft+kernels", "hf/draft"), ("ours/draft-auto+kernels", "hf/draft"),
                  ("ours/draft+kernels", "hf/draft+kernels"),
                  ("ours/ngram+kernels", "hf/ngram"), ("ours/ngram+kernels", "hf/ngram+kernels"),
                  ("plain+kernels", "plain"))


def rival(method: str) -> str | None:
    """transformers' assisted generation with the same drafter (stock kernels) for one of our methods."""
    if not method.startswith("ours/"):
        return None
    return "hf/" + method.removeprefix("ours/").split("-")[0].split("+")[0]


def add_rows(report, batch, mode, draft, prompt, results) -> None:
    plain = results.get("plain")
    for method, res in results.items():
        rate = res["tokens"] / res["seconds"]
        theirs = results.get(rival(method)) if rival(method) else None
        forwards = max(res["target_fwd"], 1)
        report.add(batch=batch, mode=mode, draft=draft if "draft" in method else "-", prompt=prompt, method=method,
                   new_tokens=res["tokens"], seconds=round(res["seconds"], 2), tokens_per_s=round(rate, 2),
                   tau=round(res["tokens"] / batch / forwards, 2),
                   draft_fwd_per_target_fwd=round(res["draft_fwd"] / forwards, 2),
                   loop_ms_per_target_fwd=round(1000 * res["loop_s"] / forwards, 1),
                   speed_vs_plain=round(rate / (plain["tokens"] / plain["seconds"]), 2) if plain else "",
                   speed_vs_hf_same_drafter=(round(rate / (theirs["tokens"] / theirs["seconds"]), 2) if theirs else ""),
                   equals_plain=(torch.equal(res["sequences"], plain["sequences"])
                                 if plain and mode == "greedy" else ""))


def _geo(values: list[float]) -> float:
    return float(torch.tensor(values, dtype=torch.float64).log().mean().exp())


def headlines(rows: list[dict]) -> list[str]:
    """Geometric means over prompts of one run's bs=1 ratios per mode, plus its bs=4 ratio."""
    notes = []
    rate = {(r["mode"], r["prompt"], r["method"]): r["tokens_per_s"] for r in rows if r["batch"] == 1}
    names = list(dict.fromkeys(r["prompt"] for r in rows if r["batch"] == 1))
    draft = next((r["draft"] for r in rows if r["draft"] != "-"), "-")
    for mode in dict.fromkeys(r["mode"] for r in rows if r["batch"] == 1):
        for ours, theirs in HEADLINE_PAIRS:
            prompts = [p for p in names if (mode, p, ours) in rate and (mode, p, theirs) in rate]
            if not prompts:
                continue
            vs = _geo([rate[(mode, p, ours)] / rate[(mode, p, theirs)] for p in prompts])
            plain = [rate[(mode, p, ours)] / rate[(mode, p, "plain")] for p in prompts
                     if (mode, p, "plain") in rate and theirs != "plain"]
            label = f"bs=1 {mode} {ours}" + (f" (draft {draft})" if "draft" in ours else "")
            notes.append(f"{label}: {vs:.2f}x {theirs}" + (f", {_geo(plain):.2f}x plain" if plain else "")
                         + " (geometric mean over prompts)")
    for r in rows:
        if r["batch"] == 4 and r["method"] != "plain":
            notes.append(f"bs=4 greedy {r['method']} on 4 summarization prompts: {r['speed_vs_plain']}x plain bs=4 "
                         f"generate (tau {r['tau']}; plain's tau is below 1 because rows that ended still ride along).")
    return notes


# ---------------------------------------------------------------------------------------------- merge
def combine() -> None:
    """Merge the ``spec.<part>.json`` results into ``spec.{json,md,png}`` (headlines recomputed from rows)."""
    parts = sorted(p for p in RESULTS_DIR.glob("spec.*.json") if p.name != "spec.json")
    if not parts:
        raise SystemExit("no benchmarks/results/spec.<part>.json to combine; run with --part NAME first")
    report = Report("spec", TITLE, COLUMNS, settings={})
    for path in parts:
        payload = json.loads(path.read_text())
        if payload["settings"].get("assistant"):  # spec --assistant parts have their own columns (spec_bounds.py)
            continue
        part = path.name.removeprefix("spec.").removesuffix(".json")
        rows, notes = payload["rows"], [note for note in payload["notes"] if note not in COMMON_NOTES]
        if STOCK_DEFAULT_KEY not in payload["settings"]:
            rows, notes = _relabel_kernels_default_part(rows, notes)
        report.rows += [row | {"part": part} for row in rows]
        report.notes += [f"[{part}] {note}" for note in notes]
        report.settings[part] = payload["settings"] | {"date": payload["environment"]["date"]}
    report.columns = ["part", *COLUMNS]
    report.notes = COMMON_NOTES + report.notes
    report.write()
    save_plot("spec", lambda fig: _draw(fig, report.rows))


def _relabel_kernels_default_part(rows: list[dict], notes: list[str]) -> tuple[list[dict], list[str]]:
    """A part measured while ours ran the decode kernels by default: ``ours/X`` -> ``ours/X+kernels``,
    ``ours/X-stock`` -> ``ours/X``, so merged tables use today's names; its headlines are recomputed."""
    def name(method: str) -> str:
        if not method.startswith("ours/"):
            return method
        return method.removesuffix("-stock") if method.endswith("-stock") else method + "+kernels"

    rows = [row | {"method": name(row["method"])} for row in rows]
    kept = [n for n in notes if not n.startswith(("bs=1 ", "bs=4 ")) and "on by default" not in n]
    return rows, kept + headlines(rows) + [
        "Measured when ours ran the decode kernels by default; rows relabelled to today's names."]


COMMON_NOTES = [
    "tokens_per_s = real new tokens (to the first EOS) / wall seconds of the generate call, prefill included; "
    "median of the repeats, methods interleaved (order rotated per repeat).",
    "tau = new tokens per target forward (hook-counted, prefill included, the same count for every loop); "
    "draft_fwd_per_target_fwd = draft forwards per target forward (K for both loops at fixed K); "
    "loop_ms_per_target_fwd = (wall - target forwards - draft forwards) / target forwards: the loop's own cost.",
    "transformers' assisted generation: num_assistant_tokens=K, num_assistant_tokens_schedule='constant', "
    "assistant_confidence_threshold=0 (so its K never adapts); ours/draft-auto is compared with that fixed-K run.",
    "equals_plain: greedy output token-identical to plain generate (sampling modes draw different tokens).",
    "Runs of 2026-12-01 on an otherwise idle 2-core machine (a few short unit-test runs overlapped some cells); "
    "ratios come from the same run, absolute speeds vary by about 5% between runs.",
    "ours/* = speculative_generate as shipped (decode_kernels=False: torch's stock kernels); "
    "ours/*+kernels = the same loop with the opt-in CPU decode kernels (decode_kernels=True); "
    "hf/*+kernels, plain+kernels = that loop inside hf_kvspec.DecodeKernels(target, draft).",
]


def _method_order(row: dict) -> int:
    known = (*METHODS, *KERNEL_VARIANTS)
    return known.index(row["method"]) if row["method"] in known else len(known)


def _draw(fig, rows) -> None:
    ax = fig.add_subplot(1, 1, 1)
    single = [r for r in rows if r["batch"] == 1]
    bars = list(dict.fromkeys((r["part"], r["mode"]) for r in single))
    labels = list(dict.fromkeys(r["method"] for r in sorted(single, key=_method_order)))
    width = 0.8 / max(len(bars), 1)
    for offset, (part, mode) in enumerate(bars):
        cell = [r for r in single if r["part"] == part and r["mode"] == mode]
        draft = next((r["draft"] for r in cell if r["draft"] != "-"), None)
        values = [statistics.mean([r["speed_vs_plain"] for r in cell if r["method"] == m] or [0]) for m in labels]
        ax.bar([i + width * offset for i in range(len(labels))], values, width=width, label=f"{part}: {mode}" + (f", draft {draft}" if draft else ""))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("speed vs plain generate (mean over prompts)")
    ax.set_title("bs=1 SmolLM2-135M on CPU: speculative vs plain vs transformers")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
