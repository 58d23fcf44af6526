"""Speculative decoding on the bundled SmolLM2-135M: tau and speed vs plain and vs transformers' assisted generation.

    python scripts/benchmark.py spec [--target smollm2|tiny] [--draft int8|bf16|truncated:N] [--new-tokens 64] [--draft-k 4]
                                     [--ngram-k 4] [--repeats 3] [--modes greedy,t=0.7] [--methods ...] [--skip-batch]
                                     [--part NAME]          # writes benchmarks/results/spec.NAME.{json,md}
    python scripts/benchmark.py spec --combine              # merges every spec.*.json part into spec.{json,md,png}
    python scripts/benchmark.py spec --assistant medusa|eagle  # bundled heads, trees (bench/spec_trees.py)
    python scripts/benchmark.py spec --assistant lookahead     # Lookahead decoding (bench/spec_lookahead.py)

Compared at bs=1 on a fixed prompt set (chat, code, summarization of a given text), greedy and temperature 0.7:
    plain       model.generate
    ours/draft  hf_kvspec.DraftModelAssistant(draft, K)           vs  hf/draft  assistant_model=same draft with
                                                                       num_assistant_tokens=K,
                                                                       num_assistant_tokens_schedule="constant",
                                                                       assistant_confidence_threshold=0
    ours/ngram  hf_kvspec.NgramAssistant(max_ngram=3, K)          vs  hf/ngram  prompt_lookup_num_tokens=K,
                                                                       max_matching_ngram_size=3
plus ours/draft-auto (same draft, K chosen per round; may fall back to plain decoding), and at bs=4 on
summarization prompts ours/ngram (K fixed, and ours/ngram-auto) vs plain generate (transformers' assisted
decoding is bs=1 only).

Both settings of the opt-in decode kernels (``hf_kvspec/kernels/``: few-row fp32 CPU linear calls through the
fastest of three measured kernels) are reported:
    ours/draft, ours/ngram, ...                  as shipped: decode_kernels=False (torch's stock kernels)
    ours/draft+kernels, ours/ngram+kernels       the same loop with decode_kernels=True
and, to read the loop's share and the kernels' share apart, the other loops with the kernels:
    hf/draft+kernels, hf/ngram+kernels,          transformers' loop / plain generate inside
    plain+kernels                                ``hf_kvspec.DecodeKernels(target, draft)``

Stand-in drafts (no trained drafter exists offline; REFERENCE.md §8):
    int8          the target with every nn.Linear dynamically quantized to int8 (per-channel weights,
                  torch.ao quantize_dynamic): same tokenizer, useful agreement, not cheaper than the target on CPU
    bf16          the target cast to bfloat16 (agrees almost always; barely cheaper on CPU)
    truncated:N   the target's first N layers + final norm + LM head (cheap for small N, agrees rarely)
(measured agreement and cost of each: docs/speculative.md, "Drafts")

Fairness: every repeat runs all methods once, in an order rotated per repeat (drift hits all methods alike); the
median of the repeats is reported. Forward hooks on the target and the draft count and time every forward, so each
row shows tau = new tokens / target forwards (prefill included, any loop), draft forwards per target forward (K
for both loops when the draft lengths really match), and the loop's own time per target forward (wall time minus
the forwards: Python, logits processing, cache crops, verification).
"""

from __future__ import annotations

import copy
import time
import warnings

import torch

from bench.harness import Report
from bench.spec_inputs import BATCH_SUMMARIES, PROMPTS, chat_inputs, new_tokens
from bench.spec_report import (
    COLUMNS,
    COMMON_NOTES,
    KERNEL_VARIANTS,
    METHODS,
    STOCK_DEFAULT,
    STOCK_DEFAULT_KEY,
    TITLE,
    add_rows,
    combine,
    headlines,
)

MODES = {"greedy": {"do_sample": False}, "t=0.7": {"do_sample": True, "temperature": 0.7}}


def add_arguments(parser) -> None:
    parser.add_argument("--target", default="smollm2", choices=["smollm2", "tiny"],
                        help="tiny: a 2-layer random Llama as target and (same weights) draft, where the loops' own "
                             "costs dominate (bs=1 greedy, plain vs ours/draft vs hf/draft only)")
    parser.add_argument("--draft", default="int8", help="stand-in draft: int8 | bf16 | truncated:N")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-k", type=int, default=4, help="K for the draft model (ours and transformers')")
    parser.add_argument("--ngram-k", type=int, default=4, help="K for n-gram drafting (ours and prompt lookup)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell, interleaved (median)")
    parser.add_argument("--modes", default="greedy,t=0.7", help="comma list of bs=1 modes (empty: none)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma list of bs=1 methods; also " + ",".join(KERNEL_VARIANTS))
    parser.add_argument("--skip-batch", action="store_true", help="skip the bs=4 comparison")
    parser.add_argument("--batch-methods", default="plain,ours/ngram,ours/ngram-auto,ours/ngram+kernels",
                        help="comma list at bs=4")
    parser.add_argument("--part", default="", help="write spec.PART.{json,md} (merge them with --combine)")
    parser.add_argument("--combine", action="store_true", help="merge spec.*.json parts into spec.{json,md,png}")
    parser.add_argument("--assistant", choices=["medusa", "eagle", "early_exit", "layer_skip", "lookahead"],
                        default=None,
                        help="bundled heads with tree verification (bench/spec_trees.py): chain vs static vs dynamic "
                             "trees on the held-out chat prompts; writes spec.PART or spec.ASSISTANT; early_exit | "
                             "layer_skip: self-speculation (bench/selfspec.py, writes spec.selfspec); lookahead: "
                             "Lookahead decoding vs plain and NgramAssistant (bench/spec_lookahead.py)")
    parser.add_argument("--exit-layer", type=int, default=None, help="with --assistant early_exit: E (default L // 2)")
    parser.add_argument("--lookahead-methods", default="",
                        help="with --assistant lookahead: comma list (see bench/spec_lookahead.py)")
    parser.add_argument("--tree-methods", default="", help="with --assistant: comma list (see bench/spec_trees.py)")
    parser.add_argument("--head-path", default=None,
                        help="with --assistant medusa|eagle: a trained head folder (config.json + model.safetensors, "
                             "e.g. a checkpoint's head/) in place of the bundled head")
    parser.add_argument("--num-prompts", type=int, default=35, help="with --assistant: held-out prompts (evenly spread)")
    parser.add_argument("--defaults", action="store_true",
                        help="every assistant with its defaults vs plain generate with and without the decode kernels, "
                             "and the c_v table (bench/spec_defaults.py; writes spec.defaults)")
    parser.add_argument("--prompt-sets", default="chat,code,summarize", help="with --defaults: chat,code,summarize")
    parser.add_argument("--default-methods", default="eagle,medusa,early_exit+adapter,ngram,ngram-auto",
                        help="with --defaults: assistants to run")
    parser.add_argument("--batch", type=int, default=1, help="with --defaults: also a greedy row at this batch size")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="with --defaults: also sampled rows at this temperature")


# ---------------------------------------------------------------------------------------------- drafts
def make_draft(model, spec: str):
    """(draft model, description) for a stand-in draft spec; see the module docstring."""
    if spec == "int8":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        with warnings.catch_warnings():  # torch.ao eager quantization is deprecated in favour of torchao
            warnings.simplefilter("ignore")
            draft = quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                     dtype=torch.qint8)
        return draft.eval(), "int8 copy of the target (every nn.Linear dynamically quantized, per-channel weights)"
    if spec == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16).eval(), "bf16 copy of the target"
    if spec.startswith("truncated:") and spec.removeprefix("truncated:").isdigit():
        from hf_kvspec.speculative.drafters.truncated import truncated_draft

        layers = int(spec.removeprefix("truncated:"))
        return truncated_draft(model, layers), (f"the target's first {layers} of {model.config.num_hidden_layers} "
                                                f"layers + final norm + LM head")
    raise ValueError(f"--draft must be int8, bf16 or truncated:N, got {spec!r}")


def draft_agreement(model, draft, sequences: list[tuple[torch.Tensor, int]]) -> float:
    """Teacher-forced top-1 agreement of draft and target on the target's own greedy continuations
    (``sequences``: (ids [1, L], prompt length)), i.e. on the text speculative decoding actually drafts."""
    agree = total = 0
    with torch.inference_mode():
        for ids, prompt_len in sequences:
            target = model(ids).logits[0, prompt_len - 1: -1].argmax(-1)
            drafted = draft(ids).logits[0, prompt_len - 1: -1].float().argmax(-1)
            agree, total = agree + int((target == drafted).sum()), total + target.numel()
    return agree / max(total, 1)


# ---------------------------------------------------------------------------------------------- timing
class _ForwardTimer:
    """Counts and times the top-level forward calls of a module (hooks; the same for every loop)."""

    def __init__(self, module):
        self.calls, self.seconds, self._start = 0, 0.0, 0.0
        self.handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.calls += 1
        self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _hf_draft(draft, k: int):
    """transformers reads the draft length from the assistant's generation config: fix it to K."""
    config = draft.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"  # no +2/-1 heuristic
    config.assistant_confidence_threshold = 0.0  # no early stop of the draft on low confidence
    return draft


def _call(method, model, draft, inputs, sampling, args):
    """One generate call; returns the sequences."""
    import hf_kvspec

    kernels = method.endswith("+kernels")  # the opt-in decode kernels
    method = method.removesuffix("+kernels")
    if kernels and not method.startswith("ours/"):  # another loop inside the same kernels' context
        with hf_kvspec.DecodeKernels(model, draft):
            return _call(method, model, draft, inputs, sampling, args)
    common = dict(**inputs, max_new_tokens=args.new_tokens, **sampling)
    if method == "plain":
        return model.generate(**common)
    if method == "hf/draft":
        return model.generate(**common, assistant_model=_hf_draft(draft, args.draft_k))
    if method == "hf/ngram":
        return model.generate(**common, prompt_lookup_num_tokens=args.ngram_k, max_matching_ngram_size=3)
    if method.startswith("ours/draft"):
        k = "auto" if method.endswith("-auto") else args.draft_k
        assistant = hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=k)
    else:
        k = "auto" if method.endswith("-auto") else args.ngram_k
        assistant = hf_kvspec.NgramAssistant(max_ngram=3, num_draft_tokens=k)
    return model.generate(**common, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          decode_kernels=kernels)


def _checked(methods: list[str]) -> list[str]:
    """Refuse a method name ``_call`` does not know (e.g. the old ``ours/*-stock``, now plain ``ours/*``)."""
    known = {*METHODS, *KERNEL_VARIANTS, "ours/ngram-auto", "ours/draft-auto+kernels", "ours/ngram-auto+kernels"}
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {sorted(known)} (ours/* runs stock kernels, "
                         f"ours/*+kernels the opt-in decode kernels)")
    return methods


def _measure_cell(methods, model, draft, inputs, sampling, args, timers, eos_id) -> dict:
    """All methods on one prompt, ``repeats`` rounds, method order rotated per round; medians per method."""
    samples = {m: [] for m in methods}
    for rep in range(args.repeats):
        order = methods[rep % len(methods):] + methods[: rep % len(methods)]
        for method in order:
            torch.manual_seed(rep)
            for timer in timers:
                timer.reset()
            start = time.perf_counter()
            with torch.inference_mode():
                sequences = _call(method, model, draft, inputs, sampling, args)
            wall = time.perf_counter() - start
            target, drafter = timers
            samples[method].append(dict(
                seconds=wall, sequences=sequences, target_fwd=target.calls,
                tokens=new_tokens(sequences, inputs["input_ids"].shape[1], eos_id),
                draft_fwd=drafter.calls if "draft" in method else 0,
                loop_s=wall - target.seconds - (drafter.seconds if "draft" in method else 0.0)))
    return {m: _median_sample(s) for m, s in samples.items()}


def _median_sample(samples: list[dict]) -> dict:
    ordered = sorted(samples, key=lambda s: s["seconds"])
    return ordered[len(ordered) // 2]


# ---------------------------------------------------------------------------------------------- run
def run(args) -> None:
    if args.combine:
        return combine()
    if args.defaults:
        from bench import spec_defaults

        return spec_defaults.run(args)
    if args.assistant == "lookahead":
        from bench import spec_lookahead

        return spec_lookahead.run(args)
    if args.assistant in ("early_exit", "layer_skip"):
        from bench import selfspec

        return selfspec.run(args)
    if args.assistant:
        from bench import spec_trees

        return spec_trees.run(args)
    if args.target == "tiny":
        return _run_tiny(args)
    from hf_kvspec.models import load_bundled_model

    model, tokenizer = load_bundled_model()
    draft, description = make_draft(model, args.draft)
    eos_id = model.generation_config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    methods = _checked([m for m in args.methods.split(",") if m])
    modes = [m for m in args.modes.split(",") if m]
    timers = (_ForwardTimer(model), _ForwardTimer(draft))
    name = f"spec.{args.part}" if args.part else "spec"
    report = Report(name, TITLE, COLUMNS,
                    settings=vars(args) | {"model": "smollm2-135m-instruct fp32", "threads": torch.get_num_threads(),
                                           STOCK_DEFAULT_KEY: STOCK_DEFAULT,
                                           "hf_assistant": "num_assistant_tokens=K, schedule=constant, "
                                                           "assistant_confidence_threshold=0"})
    with torch.inference_mode():  # warm up every path once
        warm = chat_inputs(tokenizer, ["Hi"])
        for method in (*METHODS, *KERNEL_VARIANTS):  # also times the decode kernels' choices once
            _call(method, model, draft, warm, {"do_sample": False}, args)
    continuations = []
    for mode in modes:
        for prompt, text in PROMPTS.items():
            inputs = chat_inputs(tokenizer, [text])
            results = _measure_cell(methods, model, draft, inputs, MODES[mode], args, timers, eos_id)
            add_rows(report, 1, mode, args.draft, prompt, results)
            if mode == "greedy" and "plain" in results:
                continuations.append((results["plain"]["sequences"], inputs["input_ids"].shape[1]))
    if not args.skip_batch:
        inputs = chat_inputs(tokenizer, BATCH_SUMMARIES)
        results = _measure_cell(_checked(args.batch_methods.split(",")), model, draft, inputs, {"do_sample": False}, args,
                                timers, eos_id)
        add_rows(report, 4, "greedy", "-", "summarize x4", results)
    if not continuations:  # agreement on the target's greedy answers to the prompts
        with torch.inference_mode():
            for text in PROMPTS.values():
                ids = chat_inputs(tokenizer, [text])
                continuations.append((model.generate(**ids, max_new_tokens=args.new_tokens, do_sample=False),
                                      ids["input_ids"].shape[1]))
    agreement = draft_agreement(model, draft, continuations)
    for timer in timers:
        timer.remove()
    report.notes.append(f"Draft `{args.draft}`: {description}; teacher-forced top-1 agreement with the target on "
                        f"its greedy answers to the prompts: {agreement:.1%}.")
    report.notes += headlines(report.rows) + COMMON_NOTES
    report.write()


def _run_tiny(args) -> None:
    """The loop-bound regime (REFERENCE.md §9): forwards of a 2-layer, 64-wide Llama cost so little that what each
    loop does around them decides; the draft is the target's own weights (always right, tau = K + 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # random weights: always generate the full length
    draft = copy.deepcopy(model)
    methods = ["plain", "ours/draft", "hf/draft", "ours/draft+kernels"]
    timers = (_ForwardTimer(model), _ForwardTimer(draft))
    report = Report(f"spec.{args.part or 'tiny'}", TITLE, COLUMNS,
                    settings=vars(args) | {"model": "random Llama, 2 layers, hidden 64, vocab 256",
                                           "threads": torch.get_num_threads(), STOCK_DEFAULT_KEY: STOCK_DEFAULT})
    with torch.inference_mode():
        warm = {"input_ids": torch.ones(1, 4, dtype=torch.long), "pad_token_id": 0}
        for method in methods:
            _call(method, model, draft, warm, {"do_sample": False}, args)
    for seed in range(3):
        ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(seed))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
        results = _measure_cell(methods, model, draft, inputs, {"do_sample": False}, args, timers, eos_id=-1)
        add_rows(report, 1, "greedy", "tiny-copy", f"random-{seed}", results)
    report.notes.append("Draft `tiny-copy`: the tiny target's own weights (agreement 100%); target and draft "
                        "forwards take about a millisecond, so this isolates the loops' own costs.")
    report.notes += headlines(report.rows) + COMMON_NOTES
    report.write()
