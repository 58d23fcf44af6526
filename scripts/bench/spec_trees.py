"""Medusa and EAGLE through tree verification: chain vs static tree vs dynamic tree against plain ``generate``.

    python scripts/benchmark.py spec --assistant medusa|eagle [--tree-methods M1,M2,..] [--num-prompts 35] [--repeats 3]
                                     [--modes greedy,t=0.7] [--skip-batch] [--part NAME] [--head-path DIR]

Boundary: runs the bundled SmolLM2-135M-Instruct with its committed heads on the held-out chat prompts (the prompts
the heads' cards are evaluated on, ``scripts/train_configs/chat_prompts_heldout.jsonl``) and writes one results
part; the arithmetic of rows and bounds is in ``spec_bounds.py``.

Methods (``--tree-methods``, comma list; ``plain`` is always run as the baseline):
    medusa:chain | medusa:small | medusa:default     MedusaAssistant(heads, tree=...)
    medusa:N                                         the best N-node list measured by measure_tree_choices.py
    eagle:chain:D                                    EagleAssistant(head, tree="chain", depth=D)
    eagle:static:small | eagle:static:default        EagleAssistant(head, tree=<that choice list>)
    eagle:dynamic:D:K:T                              EagleAssistant(head, depth=D, top_k=K, total_tokens=T)
    medusa:defaults | eagle:defaults                 the assistant with its defaults (what a new user gets)
    any of these + @vocabN and/or @auto               draft_vocab_size=N (FR-Spec), num_draft_tokens="auto"
    any of these + @head=NAME                         over the bundled head NAME (e.g. eagle_v2, an earlier head
                                                     kept by name) instead of the run's head: two heads, one run

Every repeat first times the target's forward over 1..64 new tokens on a warm cache of a prompt's length
(``c_v(T)`` = time(T) / time(1)), then runs every method once on each prompt, the order rotated per repeat; medians
of the repeats per (prompt, method). The draft cost per round comes from the loop's own telemetry
(``output.acceptance.draft_time_s / rounds``) in units of the one-token forward, so each row can print the bound
``tau / (c_v(N + 1) + draft)`` next to the measured speedup.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench import spec_bounds
from bench.harness import Report, load_averages
from bench.spec_bounds import COLUMNS, aggregate_rows, bound_notes, monotone

TITLE = "Medusa / EAGLE heads with tree verification on SmolLM2-135M (CPU): tau, bound and speed vs plain"
HELD_OUT = "scripts/train_configs/chat_prompts_heldout.jsonl"
TREE_CHOICES = "benchmarks/results/spec_tree_choices.json"
DEFAULT_METHODS = {
    "medusa": "medusa:chain,medusa:small,medusa:default",
    "eagle": "eagle:chain:4,eagle:static:small,eagle:dynamic:5:4:24",
}
MODES = {"greedy": {"do_sample": False}, "t=0.7": {"do_sample": True, "temperature": 0.7}}


def make_assistant(method: str, heads):
    """A fresh assistant for one ``generate`` call from a method name (see the module docstring)."""
    import hf_kvspec

    name, *options = method.split("@")
    extra = _options(method, options)
    kind, *spec = name.split(":")
    if spec == ["defaults"] and kind in ("medusa", "eagle"):
        return (hf_kvspec.MedusaAssistant if kind == "medusa" else hf_kvspec.EagleAssistant)(heads, **extra)
    if kind == "medusa" and len(spec) == 1:
        tree = _measured_choices(int(spec[0])) if spec[0].isdigit() else spec[0]
        return hf_kvspec.MedusaAssistant(heads, tree=tree, **extra)
    if kind == "eagle" and spec[:1] == ["chain"] and len(spec) == 2:
        return hf_kvspec.EagleAssistant(heads, tree="chain", depth=int(spec[1]), **extra)
    if kind == "eagle" and spec[:1] == ["static"] and len(spec) == 2:
        tree = _measured_choices(int(spec[1])) if spec[1].isdigit() else spec[1]
        return hf_kvspec.EagleAssistant(heads, tree=tree, **extra)
    if kind == "eagle" and spec[:1] == ["dynamic"] and len(spec) == 4:
        depth, top_k, total = map(int, spec[1:])
        return hf_kvspec.EagleAssistant(heads, tree="dynamic", depth=depth, top_k=top_k, total_tokens=total, **extra)
    raise SystemExit(f"unknown method {method!r}; see `scripts/benchmark.py spec --help` and bench/spec_trees.py")


def head_option(method: str) -> str | None:
    """The bundled head a method names with ``@head=NAME`` (None: the run's head)."""
    names = [option.removeprefix("head=") for option in method.split("@")[1:] if option.startswith("head=")]
    if len(names) > 1 or names == [""]:
        raise SystemExit(f"{method!r}: give one @head=NAME (a bundled head, e.g. eagle_v2)")
    return names[0] if names else None


def _options(method: str, options: list[str]) -> dict:
    """``@vocabN`` -> draft_vocab_size=N (FR-Spec), ``@auto`` -> num_draft_tokens="auto"; ``@head=NAME`` picks the
    head (``head_option``), not an assistant option."""
    extra = {}
    for option in options:
        if option.startswith("head="):
            continue
        if option == "auto":
            extra["num_draft_tokens"] = "auto"
        elif option.startswith("vocab") and option.removeprefix("vocab").isdigit():
            extra["draft_vocab_size"] = int(option.removeprefix("vocab"))
        else:
            raise SystemExit(f"unknown option @{option} in {method!r}; use @vocabN or @auto")
    return extra


def _measured_choices(nodes: int) -> list[tuple[int, ...]]:
    import json
    from pathlib import Path

    from hf_kvspec.speculative.tree import best_choices

    payload = json.loads((Path(__file__).resolve().parents[2] / TREE_CHOICES).read_text())
    values = {tuple(int(r) for r in key.split(",")): count / payload["positions"]
              for key, count in payload["counts"].items()}
    return list(best_choices(values, nodes))


def load_heads(kind: str, model, head_path: str | None = None):
    """The bundled ``kind`` head, or the trained head folder ``head_path`` (its class from ``kind``), attached."""
    import hf_kvspec

    if head_path is None:
        return hf_kvspec.load_bundled_heads(kind, base_model=model)
    if kind not in ("medusa", "eagle"):
        raise SystemExit(f"--head-path works with --assistant medusa or eagle, not {kind!r}")
    model_class = hf_kvspec.MedusaHeads if kind == "medusa" else hf_kvspec.EagleHead
    return model_class.from_pretrained(head_path, dtype=torch.float32).eval().attach(model)


def held_out_prompts(count: int) -> list[str]:
    """``count`` prompts spread evenly over the held-out file (all of them when count >= its size)."""
    from pathlib import Path

    from hf_kvspec.heads.data import read_prompts

    prompts = read_prompts(str(Path(__file__).resolve().parents[2] / HELD_OUT))
    if count >= len(prompts):
        return prompts
    step = len(prompts) / count
    return [prompts[int(i * step)] for i in range(count)]


# ---------------------------------------------------------------------------------------------- measuring
def _chat_inputs(tokenizer, prompts: list[str]) -> dict:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def _generate(model, heads: dict, method: str, inputs: dict, sampling: dict, new_tokens: int) -> dict:
    """One timed ``generate`` call -> sequences, seconds and (speculative methods) the acceptance stats.
    ``heads``: {None: the run's head, NAME: each bundled head a method names with @head=NAME}."""
    import hf_kvspec

    extra = {} if method == "plain" else dict(custom_generate=hf_kvspec.speculative_generate,
                                              assistant=make_assistant(method, heads[head_option(method)]))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, return_dict_in_generate=True, **sampling, **extra)
    return {"seconds": time.perf_counter() - start, "sequences": out.sequences, "prompt_len": inputs["input_ids"].shape[1],
            "stats": getattr(out, "acceptance", None)}


def forward_costs(model, context: int) -> dict[int, float]:
    """Seconds of one target forward over T new tokens (T in ``COST_TOKENS``) after a warm cache of ``context``."""
    return spec_bounds.forward_costs(model, context)


def _run_cells(model, heads, methods, cells, args, costs: dict) -> dict:
    """``cells`` [(key, inputs, sampling)] -> {key: {method: [samples]}}; every repeat times the forward costs
    once (into ``costs``), then runs each cell's methods once in an order rotated per repeat."""
    samples = {key: {m: [] for m in methods} for key, _, _ in cells}
    context = int(statistics.median(inputs["input_ids"].shape[1] for _, inputs, _ in cells)) + args.new_tokens // 2
    for rep in range(args.repeats):
        for tokens, seconds in forward_costs(model, context).items():
            costs.setdefault(tokens, []).append(seconds)
        for index, (key, inputs, sampling) in enumerate(cells):
            turn = (rep + index) % len(methods)
            for method in methods[turn:] + methods[:turn]:
                torch.manual_seed(1000 * rep + index)
                samples[key][method].append(_generate(model, heads, method, inputs, sampling, args.new_tokens))
            print(f"  repeat {rep + 1}/{args.repeats} {key}", flush=True)
    return samples


def run(args) -> None:
    import hf_kvspec

    model, tokenizer = hf_kvspec.load_bundled_model()
    methods = ["plain", *[m for m in (args.tree_methods or DEFAULT_METHODS[args.assistant]).split(",")
                          if m and m != "plain"]]
    heads = {None: load_heads(args.assistant, model, getattr(args, "head_path", None))}
    for name in {head_option(method) for method in methods[1:]} - {None}:
        heads[name] = hf_kvspec.load_bundled_heads(name, base_model=model)
    for method in methods[1:]:
        make_assistant(method, heads[head_option(method)])  # refuse a bad name before anything is timed
    prompts = held_out_prompts(args.num_prompts)
    cells = [((1, mode, i), _chat_inputs(tokenizer, [p]), MODES[mode])
             for mode in [m for m in args.modes.split(",") if m] for i, p in enumerate(prompts)]
    if not args.skip_batch:
        cells.append(((4, "greedy", 0), _chat_inputs(tokenizer, held_out_prompts(4)), MODES["greedy"]))
    for method in methods:  # warm-up: every path once
        _generate(model, heads, method, _chat_inputs(tokenizer, ["Hi"]), MODES["greedy"], 8)
    costs: dict[int, list[float]] = {}
    load_before = load_averages()
    samples = _run_cells(model, heads, methods, cells, args, costs)
    cost_v = monotone({t: statistics.median(s) / statistics.median(costs[1]) for t, s in costs.items()})
    step_s = statistics.median(costs[1])
    eos = model.generation_config.eos_token_id
    report = Report(f"spec.{args.part}" if args.part else f"spec.{args.assistant}", TITLE, COLUMNS,
                    settings={"assistant": args.assistant, "methods": methods, "new_tokens": args.new_tokens,
                              "repeats": args.repeats, "prompts": f"{len(prompts)} of {HELD_OUT}",
                              "modes": args.modes,
                              "batch": "" if args.skip_batch else "bs=4 greedy on 4 prompts spread over the file",
                              "threads": torch.get_num_threads(), "model": "smollm2-135m-instruct fp32",
                              "head": getattr(args, "head_path", None) or f"bundled {args.assistant}",
                              "load_average_before_after": [load_before, load_averages()]})
    for row in aggregate_rows(samples, methods, cost_v, step_s, eos[0] if isinstance(eos, list) else eos):
        report.add(**row)
    report.notes += bound_notes(report.rows, cost_v, step_s, load_before, load_averages())
    report.write()


