"""Speculative decoding on the bundled SmolLM2-135M: tau and speed vs plain and vs transformers' assisted generation.

    python scripts/benchmark.py spec [--new-tokens 24] [--draft-layers 2] [--draft-k 4] [--ngram-k 4] [--repeats 1]

Compared at bs=1 on a fixed prompt set (chat, code, summarization of a given text), greedy and temperature 0.7:
    plain       model.generate
    ours/draft  hf_kvspec.DraftModelAssistant(truncated draft, K)       vs  hf/draft  assistant_model=same draft,
                                                                            num_assistant_tokens=K (constant),
                                                                            assistant_confidence_threshold=0
    ours/ngram  hf_kvspec.NgramAssistant(max_ngram=3, K)                vs  hf/ngram  prompt_lookup_num_tokens=K,
                                                                            max_matching_ngram_size=3
plus ours/draft-auto (same draft, K chosen per round by the auto controller; may fall back to plain decoding),
and at bs=4 on summarization prompts: ours/ngram vs plain generate (transformers' assisted decoding is bs=1 only).
The draft model is a stand-in: the target's first N layers + final norm + LM head (no trained drafter yet).
tau for transformers is counted with a forward hook on the target (forwards after the prefill).
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.harness import Report, save_plot

_TEXT_A = (
    "The city council met on Tuesday to discuss the new bicycle lanes planned for the river district. Supporters "
    "said the lanes would make commuting safer and reduce traffic near the schools. Shop owners worried that "
    "removing parking spaces would hurt their business during the winter months. After two hours of debate, the "
    "council voted to build the lanes on a trial basis for one year and to review the effect on local shops."
)
_TEXT_B = (
    "Researchers at the coastal institute tracked forty sea turtles with satellite tags for three years. The "
    "turtles travelled up to two thousand kilometres between feeding grounds and nesting beaches. Warmer water "
    "pushed some feeding grounds north, and the turtles followed them. The team says protected areas should move "
    "with the animals instead of staying fixed on the map."
)
_TEXT_C = (
    "The library will close its main reading room in March for repairs to the roof, which has leaked during heavy "
    "rain for several years. Books from the reading room will move to the second floor, and study desks will be "
    "set up in the old exhibition hall. The repairs should take about four months, and the library expects to "
    "reopen the room in July with new lighting and more power outlets for laptops."
)
_TEXT_D = (
    "A small bakery in the old town started selling bread made from a grain that farmers in the region had "
    "stopped growing decades ago. The baker worked with two farms to plant the grain again and to mill it "
    "locally. The bread sells out every morning, and the farms plan to double the area they plant next year."
)

PROMPTS = {
    "chat": "What are three simple ways to sleep better at night? Answer in short sentences.",
    "code": "Write a Python function `is_palindrome(s)` that ignores case and spaces, with a docstring.",
    "summarize": f"Summarize the following text in two sentences, reusing its wording.\n\n{_TEXT_A}",
}
BATCH_SUMMARIES = [f"Summarize the following text in two sentences, reusing its wording.\n\n{text}"
                   for text in (_TEXT_A, _TEXT_B, _TEXT_C, _TEXT_D)]
MODES = {"greedy": {"do_sample": False}, "t=0.7": {"do_sample": True, "temperature": 0.7}}
METHODS = ("plain", "ours/draft", "hf/draft", "ours/draft-auto", "ours/ngram", "hf/ngram")


def add_arguments(parser) -> None:
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--draft-layers", type=int, default=2, help="layers of the truncated stand-in draft")
    parser.add_argument("--draft-k", type=int, default=4, help="K for the draft model (ours and transformers')")
    parser.add_argument("--ngram-k", type=int, default=4, help="K for n-gram drafting (ours and prompt lookup)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cell (median)")
    parser.add_argument("--skip-batch", action="store_true", help="skip the bs=4 comparison")


class _ForwardCounter:
    """Counts forward calls of a module (target forwards of any generate loop)."""

    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def _chat_inputs(tokenizer, prompts: list[str]) -> dict:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def _hf_draft(draft, k: int):
    config = draft.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
    config.assistant_confidence_threshold = 0.0
    return draft


def _call(method, model, draft, inputs, sampling, args):
    """One generate call; returns (sequences, acceptance stats or None)."""
    import hf_kvspec

    common = dict(**inputs, max_new_tokens=args.new_tokens, **sampling)
    if method == "plain":
        return model.generate(**common), None
    if method == "hf/draft":
        return model.generate(**common, assistant_model=_hf_draft(draft, args.draft_k)), None
    if method == "hf/ngram":
        return model.generate(**common, prompt_lookup_num_tokens=args.ngram_k, max_matching_ngram_size=3), None
    if method.startswith("ours/draft"):
        k = "auto" if method.endswith("-auto") else args.draft_k
        assistant = hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=k)
    else:
        assistant = hf_kvspec.NgramAssistant(max_ngram=3, num_draft_tokens=args.ngram_k)
    out = model.generate(**common, custom_generate=hf_kvspec.speculative_generate, assistant=assistant)
    return out, assistant.stats


def _new_tokens(sequences: torch.Tensor, prompt_len: int, eos_id: int) -> int:
    """Real new tokens: up to and including each row's first EOS."""
    total = 0
    for row in sequences[:, prompt_len:].tolist():
        total += row.index(eos_id) + 1 if eos_id in row else len(row)
    return total


def _measure(method, model, draft, inputs, sampling, args, counter, eos_id):
    samples, result = [], None
    for rep in range(args.repeats):
        torch.manual_seed(rep)
        counter.calls = 0
        start = time.perf_counter()
        with torch.inference_mode():
            sequences, stats = _call(method, model, draft, inputs, sampling, args)
        samples.append(time.perf_counter() - start)
        tokens = _new_tokens(sequences, inputs["input_ids"].shape[1], eos_id)
        # tau: tokens after the prefill's first token, per target forward after the prefill (per row at bs>1)
        tau = stats.tokens_per_target_forward if stats else (tokens / sequences.shape[0] - 1) / max(counter.calls - 1, 1)
        result = dict(tokens=tokens, tau=tau, sequences=sequences)
    result["seconds"] = statistics.median(samples)
    return result


def _draft_agreement(model, draft, tokenizer) -> float:
    """Teacher-forced top-1 agreement of draft and target on the prompts' own text (REFERENCE.md §9)."""
    ids = tokenizer(" ".join(BATCH_SUMMARIES), return_tensors="pt").input_ids
    with torch.inference_mode():
        return float((model(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1)).float().mean())


def run(args) -> None:
    from hf_kvspec.models import load_bundled_model
    from hf_kvspec.speculative.drafters.truncated import truncated_draft

    model, tokenizer = load_bundled_model()
    draft = truncated_draft(model, args.draft_layers)
    eos_id = model.generation_config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    counter = _ForwardCounter(model)
    report = Report("spec", "Speculative decoding on SmolLM2-135M (CPU): tau and speed vs plain and vs transformers",
                    ["batch", "mode", "prompt", "method", "new_tokens", "seconds", "tokens_per_s", "tau",
                     "speed_vs_plain", "speed_vs_hf_same_drafter", "equals_plain"],
                    settings=vars(args) | {"model": "smollm2-135m-instruct fp32", "threads": torch.get_num_threads()})
    agreement = _draft_agreement(model, draft, tokenizer)
    report.notes += [
        f"Draft model: stand-in = the target's first {args.draft_layers} of {model.config.num_hidden_layers} layers "
        f"+ final norm + LM head (no trained drafter yet); teacher-forced top-1 agreement with the target on the "
        f"summarization texts: {agreement:.1%}.",
        "tokens_per_s = real new tokens (to the first EOS) / wall seconds of the generate call, prefill included.",
        "speed ratios are tokens/s ratios measured in the same run; the machine was shared with other jobs (noisy).",
        "equals_plain: greedy output token-identical to plain generate (sampling modes draw different tokens).",
        "speed_vs_hf_same_drafter of ours/draft-auto compares against hf/draft at fixed K (auto K is ours only).",
    ]
    with torch.inference_mode():  # warm up every path once
        warm = _chat_inputs(tokenizer, ["Hi"])
        for method in METHODS:
            _call(method, model, draft, warm, {"do_sample": False}, args)
    speeds = {}
    for mode, sampling in MODES.items():
        for name, prompt in PROMPTS.items():
            inputs = _chat_inputs(tokenizer, [prompt])
            results = {m: _measure(m, model, draft, inputs, sampling, args, counter, eos_id) for m in METHODS}
            _add_rows(report, 1, mode, name, results)
            for method, res in results.items():
                speeds.setdefault((mode, method), []).append(res["tokens"] / res["seconds"])
    if not args.skip_batch:
        inputs = _chat_inputs(tokenizer, BATCH_SUMMARIES)
        results = {m: _measure(m, model, draft, inputs, {"do_sample": False}, args, counter, eos_id)
                   for m in ("plain", "ours/ngram")}
        _add_rows(report, 4, "greedy", "summarize x4", results)
        ratio = (results["ours/ngram"]["tokens"] / results["ours/ngram"]["seconds"]) / (
            results["plain"]["tokens"] / results["plain"]["seconds"])
        report.notes.append(f"bs=4 greedy ours/ngram on 4 summarization prompts: {ratio:.2f}x plain bs=4 generate.")
    _summary(report, speeds)
    counter.handle.remove()
    report.write()
    save_plot("spec", lambda fig: _draw(fig, speeds))


def _add_rows(report, batch, mode, prompt, results) -> None:
    plain = results["plain"]
    for method, res in results.items():
        rate = res["tokens"] / res["seconds"]
        rival = results.get(method.replace("ours/", "hf/").removesuffix("-auto")) if method.startswith("ours/") else None
        report.add(batch=batch, mode=mode, prompt=prompt, method=method, new_tokens=res["tokens"],
                   seconds=round(res["seconds"], 2), tokens_per_s=round(rate, 2), tau=round(res["tau"], 2),
                   speed_vs_plain=round(rate / (plain["tokens"] / plain["seconds"]), 2),
                   speed_vs_hf_same_drafter=(round(rate / (rival["tokens"] / rival["seconds"]), 2) if rival else ""),
                   equals_plain=(torch.equal(res["sequences"], plain["sequences"]) if mode == "greedy" else ""))


def _summary(report, speeds) -> None:
    """Geometric means over prompts per mode, as notes (the headline figures)."""
    def geo(values):
        return float(torch.tensor(values).log().mean().exp())

    for mode in MODES:
        plain = geo(speeds[(mode, "plain")])
        for ours, theirs in (("ours/draft", "hf/draft"), ("ours/draft-auto", "hf/draft"), ("ours/ngram", "hf/ngram")):
            mine, rival = geo(speeds[(mode, ours)]), geo(speeds[(mode, theirs)])
            report.notes.append(f"bs=1 {mode} {ours}: {mine / plain:.2f}x plain, {mine / rival:.2f}x {theirs} "
                                f"(geometric mean over prompts)")


def _draw(fig, speeds) -> None:
    ax = fig.add_subplot(1, 1, 1)
    labels = list(METHODS)
    for offset, mode in enumerate(MODES):
        values = [statistics.mean(speeds[(mode, m)]) for m in labels]
        ax.bar([i + 0.4 * offset for i in range(len(labels))], values, width=0.4, label=mode)
    ax.set_xticks([i + 0.2 for i in range(len(labels))], labels)
    ax.set_ylabel("tokens/s (mean over prompts)")
    ax.set_title("bs=1 SmolLM2-135M on CPU: speculative vs plain vs transformers")
    ax.legend()
