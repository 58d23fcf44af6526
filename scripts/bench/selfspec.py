"""Self-speculation on the bundled SmolLM2-135M: early exit / layer skipping vs plain and vs transformers' early exit.

    python scripts/benchmark.py spec --assistant early_exit [--exit-layer 15] [--draft-k 4] [--new-tokens 48]
    python scripts/benchmark.py spec --assistant layer_skip [--draft-k 4]
    # writes benchmarks/results/spec.selfspec.{json,md}

Methods, bs=1, greedy, chat prompts, interleaved per repeat (median of the repeats):
    plain             model.generate
    ours/early_exit   hf_kvspec.EarlyExitAssistant(E, K) on the target's own cache
    hf/early_exit     generate(assistant_early_exit=E) with the assistant generation config's
                      num_assistant_tokens=K (constant schedule) and assistant_confidence_threshold=0
    ours/*-auto       the same drafter with K chosen per round
    ours/layer_skip   hf_kvspec.LayerSkipAssistant(skip set searched once on the first prompt, K)

Columns: tau (tokens per target verify), speed vs plain and vs hf/early_exit, identical output, layer forwards
per generated token (forward pre-hooks on every decoder layer count the columns each call processes, divided by
the layer count: plain decoding is 1.0), and the bound ``tau / layer_forwards_per_round`` in those units (what the
speed would be if a column through one layer cost the same in every call). The machine load (``uptime``) is
recorded with the results, since the CPU is shared.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about autumn leaves.",
    "What are three tips for staying focused while studying?",
    "Describe how a bicycle works to a child.",
]


def _count_layers(model):
    """Pre-hooks on every decoder layer; returns (counter dict, handles)."""
    counter = {"columns": 0}
    handles = [layer.register_forward_pre_hook(
        lambda module, args, kwargs: counter.__setitem__("columns", counter["columns"] + _columns(args, kwargs)),
        with_kwargs=True) for layer in model.model.layers]
    return counter, handles


def _columns(args, kwargs) -> int:
    hidden = args[0] if args else kwargs["hidden_states"]
    return int(hidden.shape[1])


def _call(method, model, inputs, args, skip):
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
        assistant = hf_kvspec.EarlyExitAssistant(args.exit_layer, num_draft_tokens=k)
    else:
        assistant = hf_kvspec.LayerSkipAssistant(skip, num_draft_tokens=k)
    out = model.generate(**common, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                         return_dict_in_generate=True)
    return out.sequences, out.acceptance


def run(args) -> None:
    from bench.harness import Report
    from hf_kvspec.models import load_bundled_model

    model, tokenizer = load_bundled_model()
    layers = model.config.num_hidden_layers
    args.exit_layer = args.exit_layer or layers // 2
    inputs = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True) for p in PROMPTS]
    skip = None
    if args.assistant == "layer_skip":
        searcher = hf_kvspec_layer_skip(model, inputs[0]["input_ids"], args.draft_k)
        skip = searcher.skip_layers
        methods = ["plain", "ours/layer_skip", "ours/layer_skip-auto"]
    else:
        methods = ["plain", "ours/early_exit", "hf/early_exit", "ours/early_exit-auto"]
    rows = _measure(methods, model, inputs, args, skip, layers)
    report = Report("spec.selfspec", "Self-speculation on the bundled model (bs=1, greedy)",
                    columns=["method", "seconds", "vs_plain", "vs_hf_early_exit", "identical", "tau",
                             "layer_forwards_per_token", "bound"],
                    notes=[f"uptime: {os.popen('uptime').read().strip()}"],
                    settings=dict(exit_layer=args.exit_layer, draft_k=args.draft_k, skip_layers=skip,
                                  new_tokens=args.new_tokens, repeats=args.repeats,
                                  threads=torch.get_num_threads()))
    for row in rows:
        report.add(**row)
    report.write()


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


def _measure(methods, model, inputs, args, skip, layers) -> list[dict]:
    times = {m: [] for m in methods}
    outputs, taus, columns = {}, {m: [] for m in methods}, {m: [] for m in methods}
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]  # rotate: drift hits all alike
        for method in order:
            for i, prompt in enumerate(inputs):
                counter, handles = _count_layers(model)
                start = time.perf_counter()
                try:
                    sequences, stats = _call(method, model, prompt, args, skip)
                finally:
                    for handle in handles:
                        handle.remove()
                times[method].append((i, time.perf_counter() - start))
                new = sequences.shape[1] - prompt["input_ids"].shape[1]
                outputs.setdefault((method, i), sequences)
                columns[method].append(counter["columns"] / layers / max(new, 1))
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
        work = statistics.mean(columns[method])
        rows.append(dict(method=method, seconds=round(total, 3), vs_plain=round(base / total, 3),
                         vs_hf_early_exit=round(hf / total, 3) if hf else None, identical=same,
                         tau=round(tau, 3) if tau else None, layer_forwards_per_token=round(work, 3),
                         bound=round(1.0 / work, 3)))
    return rows
