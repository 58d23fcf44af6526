"""Lookahead decoding against plain ``generate`` and prompt lookup (``NgramAssistant``) in the same run.

    python scripts/benchmark.py spec --assistant lookahead [--lookahead-methods M1,M2,..] [--prompt-sets chat,code,summarize]
                                     [--num-prompts 8] [--repeats 3] [--new-tokens 64] [--modes greedy,t=0.7]
    python scripts/benchmark.py spec --assistant lookahead --target tiny --num-prompts 2 --repeats 1   # smoke

Boundary: runs the bundled SmolLM2-135M-Instruct (or, ``--target tiny``, a 2-layer random Llama on token-id prompts:
a smoke run of the code paths, not a measurement) and writes one results part, ``spec.lookahead``; the bound's
arithmetic is ``spec_bounds.py``'s.

Methods (``--lookahead-methods``, comma list; ``plain`` and ``ngram`` always run, the baselines of every ratio):
    ngram                       NgramAssistant() (its defaults: 3-token match, 8 drafts)
    ngram-auto                  NgramAssistant(num_draft_tokens="auto")
    lookahead[:W[:N[:G]]]       LookaheadAssistant(W, N, G) with auto sizing (the default method: its defaults)
    ...@K                       the same with a fixed shape, at most K verified nodes per round

Every repeat first times the target's forward over T new tokens on a warm cache (``c_v(T)``, monotone fit), then
runs each method once per prompt, the order rotated per prompt and repeat; per (prompt, method) the median repeat
counts. A round of Lookahead feeds the root, the verification nodes and the window, so its ``c_v`` is read at the
tokens each target forward actually fed (counted by a forward hook, prefill excluded): ``bound = tau / (c_v(fed)
+ draft)``. ``vs_plain`` / ``vs_ngram`` are speeds over plain generate / NgramAssistant on the same prompts.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench import spec_bounds
from bench.harness import Report, load_averages
from bench.spec_bounds import interpolate, monotone, new_tokens

TITLE = "Lookahead decoding vs plain generate and NgramAssistant (exact; tau, c_v of the combined forward, bound)"
COLUMNS = ["prompts", "mode", "method", "tau", "nodes", "fed", "c_v", "draft_steps", "bound", "tokens_per_s",
           "vs_plain", "vs_ngram", "fallback_rounds", "equals_plain"]
DEFAULT_METHODS = "lookahead,lookahead:5:4:5@16,lookahead:3:3:3@8,ngram-auto"
MODES = {"greedy": {"do_sample": False}, "t=0.7": {"do_sample": True, "temperature": 0.7}}


def make_assistant(method: str):
    """A fresh assistant for one call from a method name (module docstring)."""
    import hf_kvspec
    from hf_kvspec.speculative.assistants import check_spec

    name, _, fixed = method.partition("@")
    if name in ("ngram", "ngram-auto"):
        return hf_kvspec.NgramAssistant(**({"num_draft_tokens": "auto"} if name == "ngram-auto" else {}))
    kind, sizes = check_spec(name) if name.startswith("lookahead") else (None, None)
    if kind != "lookahead" or (fixed and not fixed.isdigit()):
        raise SystemExit(f"unknown method {method!r}; use ngram, ngram-auto or lookahead[:W[:N[:G]]][@K]")
    return hf_kvspec.LookaheadAssistant(*sizes, num_draft_tokens=int(fixed) if fixed else "auto")


class FedTokens:
    """Tokens each forward of ``model`` fed (a forward pre-hook), for the combined forward's ``c_v``."""

    def __init__(self, model):
        self.counts: list[int] = []
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.counts.append(int(ids.shape[1]))

    def take(self) -> list[int]:
        counts, self.counts = self.counts, []
        return counts

    def remove(self) -> None:
        self.handle.remove()


def forward_costs(model, context: int, vocab: int) -> dict[int, float]:
    """Seconds of one target forward over T new tokens after a warm cache of ``context`` tokens."""
    return spec_bounds.forward_costs(model, context, 3, vocab)


def _generate(model, method: str, inputs: dict, sampling: dict, args, fed: FedTokens) -> dict:
    import hf_kvspec

    extra = {} if method == "plain" else dict(custom_generate=hf_kvspec.speculative_generate,
                                              assistant=make_assistant(method))
    fed.take()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=args.new_tokens, return_dict_in_generate=True,
                             pad_token_id=args.pad_id, **sampling, **extra)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "sequences": out.sequences, "prompt_len": inputs["input_ids"].shape[1],
            "stats": getattr(out, "acceptance", None), "fed": fed.take()[1:]}  # [0] is the prefill


def _median(samples: list[dict]) -> dict:
    return sorted(samples, key=lambda s: s["seconds"])[len(samples) // 2]


def _row(kind: str, mode: str, method: str, picked: list[dict], rates: dict, cost_v: dict, step_s: float,
         equal, eos_id) -> dict:
    tokens = sum(new_tokens(s["sequences"], s["prompt_len"], eos_id) for s in picked)
    rate = tokens / sum(s["seconds"] for s in picked)
    row = {"prompts": f"{kind} x{len(picked)}", "mode": mode, "method": method, "tokens_per_s": round(rate, 2),
           "vs_plain": round(rate / rates["plain"], 3), "vs_ngram": round(rate / rates["ngram"], 3),
           "equals_plain": equal}
    stats = [s["stats"] for s in picked if s["stats"] is not None]
    if not stats:
        return row | {"tau": 1.0, "nodes": 0, "fed": 1, "c_v": 1.0, "draft_steps": 0.0, "bound": 1.0}
    tau = sum(s.emitted_tokens for s in stats) / sum(s.row_rounds for s in stats)
    fed = [n for s in picked for n in s["fed"]] or [1]
    c_v = statistics.mean(interpolate(cost_v, n) for n in fed)
    rounds = sum(s.rounds for s in stats)
    draft = sum(s.draft_time_s for s in stats) / rounds / step_s
    return row | {"tau": round(tau, 3), "nodes": round(statistics.mean(n for s in stats for n in s.draft_lengths), 1),
                  "fed": round(statistics.mean(fed), 1), "c_v": round(c_v, 2), "draft_steps": round(draft, 2),
                  "bound": round(tau / (c_v + draft), 3),
                  "fallback_rounds": round(sum(s.fallback_rounds for s in stats) / rounds, 2)}


def _cells(args, tokenizer) -> list[tuple[str, str, dict]]:
    """``(prompt set, mode, inputs)`` per prompt, bs=1."""
    cells = []
    for kind in [k for k in args.prompt_sets.split(",") if k]:
        for prompt in _prompts(args, kind):
            inputs = _token_inputs(prompt) if tokenizer is None else _chat(tokenizer, prompt)
            cells += [(kind, mode, inputs) for mode in [m for m in args.modes.split(",") if m]]
    return cells


def _prompts(args, kind: str) -> list:
    if args.target == "tiny":  # token-id prompts: a loop to copy ("code") and noise ("chat")
        gen = torch.Generator().manual_seed(len(kind))
        loop = torch.randint(3, 250, (12,), generator=gen).tolist()
        return [loop * 3 if kind == "code" else torch.randint(3, 250, (36,), generator=gen).tolist()
                for _ in range(args.num_prompts)]
    from bench.spec_defaults import load_prompts

    return load_prompts(kind, args.num_prompts)


def _token_inputs(prompt: list[int]) -> dict:
    ids = torch.tensor([prompt])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _chat(tokenizer, prompt: str) -> dict:
    from bench.spec_inputs import chat_inputs

    return dict(chat_inputs(tokenizer, [prompt]))


def _load(args):
    if args.target != "tiny":
        from hf_kvspec.models import load_bundled_model

        model, tokenizer = load_bundled_model()
        eos = model.generation_config.eos_token_id
        return model, tokenizer, eos[0] if isinstance(eos, list) else eos, "smollm2-135m-instruct fp32"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # random weights: always the full length
    return model, None, None, "random Llama, 2 layers, hidden 64, vocab 256 (smoke run)"


def run(args) -> None:
    model, tokenizer, eos_id, description = _load(args)
    args.pad_id = eos_id if eos_id is not None else 0
    methods = list(dict.fromkeys(["plain", "ngram", *[m for m in (args.lookahead_methods or DEFAULT_METHODS)
                                                        .split(",") if m]]))
    for method in methods[1:]:
        make_assistant(method)  # refuse a bad name before anything is timed
    cells = _cells(args, tokenizer)
    fed = FedTokens(model)
    for method in methods:  # warm-up: every path once
        _generate(model, method, cells[0][2], MODES["greedy"], args, fed)
    samples = {index: {m: [] for m in methods} for index in range(len(cells))}
    costs: dict[int, list[float]] = {}
    context = int(statistics.median(c[2]["input_ids"].shape[1] for c in cells)) + args.new_tokens // 2
    load_before = load_averages()
    for repeat in range(args.repeats):
        for tokens, seconds in forward_costs(model, context, model.config.vocab_size).items():
            costs.setdefault(tokens, []).append(seconds)
        for index, (_, mode, inputs) in enumerate(cells):
            turn = (repeat + index) % len(methods)
            for method in methods[turn:] + methods[:turn]:
                torch.manual_seed(1000 * repeat + index)
                samples[index][method].append(_generate(model, method, inputs, MODES[mode], args, fed))
        print(f"  repeat {repeat + 1}/{args.repeats}", flush=True)
    fed.remove()
    step_s = statistics.median(costs[1])
    cost_v = monotone({t: statistics.median(s) / step_s for t, s in costs.items()})
    report = Report(f"spec.{args.part}" if args.part else "spec.lookahead", TITLE, COLUMNS,
                    settings={"methods": methods, "new_tokens": args.new_tokens, "repeats": args.repeats,
                              "prompt_sets": args.prompt_sets, "prompts_per_set": args.num_prompts,
                              "modes": args.modes, "threads": torch.get_num_threads(), "model": description,
                              "load_average_before_after": [load_before, load_averages()]})
    _add_rows(report, cells, samples, methods, cost_v, step_s, eos_id)
    report.notes += [
        f"One 1-token forward (warm {context}-token cache): {step_s * 1e3:.2f} ms; c_v(T) (monotone fit): "
        + ", ".join(f"{t}: {v:.2f}" for t, v in cost_v.items()) + ".",
        "fed = mean tokens per target forward (root + nodes + lookahead window); c_v = mean c_v(fed); bound = tau / "
        "(c_v + draft_steps); fallback_rounds = share of rounds with no verified node (auto chose plain decoding, "
        "or no candidate); equals_plain = greedy output identical to plain generate on every prompt and repeat."]
    report.write()


def _add_rows(report, cells, samples, methods, cost_v, step_s, eos_id) -> None:
    for kind, mode in dict.fromkeys((k, m) for k, m, _ in cells):
        indices = [i for i, (k, m, _) in enumerate(cells) if (k, m) == (kind, mode)]
        picked = {m: [_median(samples[i][m]) for i in indices] for m in methods}
        rates = {m: sum(new_tokens(s["sequences"], s["prompt_len"], eos_id) for s in p) / sum(s["seconds"] for s in p)
                 for m, p in picked.items()}
        for method in methods:
            equal = "-"
            if mode == "greedy":
                equal = all(torch.equal(s["sequences"], samples[i]["plain"][0]["sequences"])
                            for i in indices for s in samples[i][method])
            report.add(**_row(kind, mode, method, picked[method], rates, cost_v, step_s, equal, eos_id))


