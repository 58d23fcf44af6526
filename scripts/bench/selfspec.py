"""Self-speculation on the bundled SmolLM2-135M: early exit / layer skipping vs plain and vs transformers' early exit.

    python scripts/benchmark.py spec --assistant early_exit [--exit-layer E] [--draft-k 4] [--new-tokens 48]
    python scripts/benchmark.py spec --assistant layer_skip [--draft-k 4]
    # writes benchmarks/results/spec.selfspec.{json,md}

Methods, bs=1, greedy, four held-out chat prompts (never trained on), interleaved per repeat (median of the repeats):
    plain             model.generate
    ours/early_exit   hf_kvspec.EarlyExitAssistant(E, K) on the target's own cache
    ours/early_exit+adapter[-auto]  the same with the bundled exit adapter (load_bundled_heads("early_exit")); E
                      defaults to the adapter's exit layer when it is installed, so every row runs at the same E
    hf/early_exit     generate(assistant_early_exit=E) with the assistant generation config's
                      num_assistant_tokens=K (constant schedule) and assistant_confidence_threshold=0
    ours/*-auto       the same drafter with K chosen per round
    ours/layer_skip   hf_kvspec.LayerSkipAssistant(skip set searched once on the first prompt, K)

Columns: tau (tokens per target verify), speed vs plain and vs hf/early_exit, identical output, layer forwards
per generated token (forward pre-hooks on every decoder layer count the columns each call processes, divided by
the layer count; the prefill is included), and ``bound``: plain's weighted work per generated token / the method's,
where a column through a decoder layer, through the LM head and through the adapter each weigh their parameter
count (plain = 1). It is the speed if time were proportional to
column x weights, i.e. compute-bound; batched verify columns cost less than that on a memory-bound device, so a
speed above the bound is possible. The machine load (``uptime``) is recorded with the results: the CPU is shared.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

HELD_OUT = Path(__file__).resolve().parents[1] / "train_configs" / "chat_prompts_heldout.jsonl"
PROMPT_ROWS = (0, 9, 18, 27)  # four topics of the held-out file


def _prompts() -> list[str]:
    from hf_kvspec.heads.data import read_prompts

    prompts = read_prompts(str(HELD_OUT))
    return [prompts[i] for i in PROMPT_ROWS]


def _count_layers(model, adapter=None):
    """Pre-hooks counting columns: every decoder layer ("columns"), the LM head ("head"), the adapter ("adapter")."""
    counter = {"columns": 0, "head": 0, "adapter": 0}

    def counting(key):
        return lambda module, args, kwargs: counter.__setitem__(key, counter[key] + _columns(args, kwargs))

    modules = [(layer, "columns") for layer in model.model.layers] + [(model.get_output_embeddings(), "head")]
    modules += [(adapter, "adapter")] if adapter is not None else []
    handles = [module.register_forward_pre_hook(counting(key), with_kwargs=True) for module, key in modules]
    return counter, handles


def _weights(model, adapter) -> dict:
    """Parameters per column of each counted kind, in units of one decoder layer."""
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    head = model.get_output_embeddings().weight.numel()
    return {"columns": 1.0, "head": head / layer,
            "adapter": sum(p.numel() for p in adapter.parameters()) / layer if adapter is not None else 0.0}


def _columns(args, kwargs) -> int:
    hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
    return int(hidden.shape[-2]) if hidden.dim() > 1 else 1


def _call(method, model, inputs, args, skip, adapter=None):
    import hf_kvspec

    common = dict(**inputs, max_new_tokens=args.new_tokens, do_sample=False)
    k = "auto" if method.endswith("-auto") else args.draft_k
    if method == "plain":
        return model.generate(**common), None
    if method == "hf/early_exit":
        config = model.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = args.draft_k, "constant"
        config.assistant_confidence_threshold = 0.0
        return model.generate(**common, assistant_early_exit=args.exit_layer), None
    if method.startswith("ours/early_exit"):
        with_adapter = adapter if "+adapter" in method else None
        assistant = hf_kvspec.EarlyExitAssistant(args.exit_layer, num_draft_tokens=k, adapter=with_adapter)
    else:
        assistant = hf_kvspec.LayerSkipAssistant(skip, num_draft_tokens=k)
    out = model.generate(**common, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                         return_dict_in_generate=True)
    return out.sequences, out.acceptance


def run(args) -> None:
    from bench.harness import Report
    from hf_kvspec.models import load_bundled_model

    uptime_before = os.popen("uptime").read().strip()
    model, tokenizer = load_bundled_model()
    layers = model.config.num_hidden_layers
    adapter = _bundled_adapter(model) if args.assistant == "early_exit" else None
    args.exit_layer = args.exit_layer or (adapter.config.exit_layer if adapter is not None else layers // 2)
    if adapter is not None and adapter.config.exit_layer != args.exit_layer:
        print(f"the bundled adapter exits at E={adapter.config.exit_layer}, not {args.exit_layer}: no adapter rows")
        adapter = None
    inputs = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True) for p in _prompts()]
    skip = None
    if args.assistant == "layer_skip":
        searcher = hf_kvspec_layer_skip(model, inputs[0]["input_ids"], args.draft_k)
        skip = searcher.skip_layers
        methods = ["plain", "ours/layer_skip", "ours/layer_skip-auto"]
    else:
        methods = ["plain", "ours/early_exit", "hf/early_exit", "ours/early_exit-auto"]
        methods += ["ours/early_exit+adapter", "ours/early_exit+adapter-auto"] if adapter is not None else []
    rows = _measure(methods, model, inputs, args, skip, layers, adapter)
    report = Report("spec.selfspec", "Self-speculation on the bundled model (bs=1, greedy)",
                    columns=["method", "seconds", "vs_plain", "vs_hf_early_exit", "identical", "tau",
                             "layer_forwards_per_token", "bound", "speed_over_bound"],
                    notes=[f"uptime before: {uptime_before}", f"uptime after: {os.popen('uptime').read().strip()}",
                           "timings from a shared, loaded CPU (see the load averages): compare rows, not machines"],
                    settings=dict(exit_layer=args.exit_layer, draft_k=args.draft_k, skip_layers=skip,
                                  new_tokens=args.new_tokens, repeats=args.repeats,
                                  threads=torch.get_num_threads()))
    for row in rows:
        report.add(**row)
    report.write()


def _bundled_adapter(model):
    """The committed exit adapter attached to ``model``, or None when none is installed."""
    from hf_kvspec.heads.bundled import load_bundled_heads

    try:
        return load_bundled_heads("early_exit", base_model=model)
    except FileNotFoundError:
        return None


def hf_kvspec_layer_skip(model, prompt, k):
    """The searched skip set (timed: the search's cost on this machine goes into the results)."""
    import hf_kvspec
    from hf_kvspec.speculative.partial_forward import PartialForward

    assistant = hf_kvspec.LayerSkipAssistant("search", num_draft_tokens=k)
    assistant.stack = PartialForward(model)
    start = time.perf_counter()
    with torch.no_grad():
        assistant.skip_layers = assistant.search(prompt)
    assistant.search_seconds = time.perf_counter() - start
    print(f"search: {assistant.skip_layers} in {assistant.search_seconds:.1f}s")
    return assistant


def _measure(methods, model, inputs, args, skip, layers, adapter=None) -> list[dict]:
    times = {m: [] for m in methods}
    outputs, taus, columns, work = {}, {m: [] for m in methods}, {m: [] for m in methods}, {m: [] for m in methods}
    weight = _weights(model, adapter)
    plain_token = layers + weight["head"]  # one generated token of plain decoding
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]  # rotate: drift hits all alike
        for method in order:
            for i, prompt in enumerate(inputs):
                counter, handles = _count_layers(model, adapter)
                start = time.perf_counter()
                try:
                    sequences, stats = _call(method, model, prompt, args, skip, adapter)
                finally:
                    for handle in handles:
                        handle.remove()
                times[method].append((i, time.perf_counter() - start))
                new = sequences.shape[1] - prompt["input_ids"].shape[1]
                outputs.setdefault((method, i), sequences)
                columns[method].append(counter["columns"] / layers / max(new, 1))
                work[method].append(sum(weight[key] * counter[key] for key in weight) / plain_token / max(new, 1))
                if stats is not None:
                    taus[method].append(stats.tokens_per_target_forward)
    rows = []
    per_prompt = {m: [statistics.median(t for j, t in times[m] if j == i) for i in range(len(inputs))]
                  for m in methods}
    base = sum(per_prompt["plain"])
    hf = sum(per_prompt["hf/early_exit"]) if "hf/early_exit" in per_prompt else None
    for method in methods:
        total = sum(per_prompt[method])
        same = all(torch.equal(outputs[(method, i)], outputs[("plain", i)]) for i in range(len(inputs)))
        tau = statistics.mean(taus[method]) if taus[method] else None
        bound = statistics.mean(work["plain"]) / statistics.mean(work[method])  # plain = 1 (prefill included)
        rows.append(dict(method=method, seconds=round(total, 3), vs_plain=round(base / total, 3),
                         vs_hf_early_exit=round(hf / total, 3) if hf else None, identical=same,
                         tau=round(tau, 3) if tau else None,
                         layer_forwards_per_token=round(statistics.mean(columns[method]), 3),
                         bound=round(bound, 3), speed_over_bound=round(base / total / bound, 3)))
    return rows
