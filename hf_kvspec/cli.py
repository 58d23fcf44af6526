"""``hf-kvspec`` command line: ``generate`` on the bundled model, ``batch`` (offline continuous batching),
``serve`` (an OpenAI-compatible server), ``memory`` arithmetic and ``export-heads``.

Boundary: argument parsing and printing only; every computation lives in the library. Arguments are checked
before anything heavy runs (types in ``argparse``, combinations in ``_check_*``), and torch/transformers are
imported only by the command that runs, so ``hf-kvspec --help`` stays instant.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import re
import sys
import time
from pathlib import Path

_DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp8")


def _vocab_size(text: str) -> int | str:
    """``--draft-vocab-size``: a positive int or ``full``."""
    return "full" if text == "full" else _count(1)(text)


def _count(minimum: int):
    """An argparse ``type=``: an int of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"needs an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"needs an integer >= {minimum}, got {value}")
        return value
    return parse


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"needs a finite number >= 0 (0 = greedy), got {text!r}")
    return value


def _port(text: str) -> int:
    value = _count(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"needs a TCP port in 0..65535, got {value}")
    return value


def _draft_tokens(text: str) -> int | str:
    if text == "auto" or text.isdigit():
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"takes a non-negative int or 'auto', got {text!r}")


def _byte_size(text: str) -> int:
    from hf_kvspec.memory import parse_bytes

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"needs a positive size, e.g. '80GiB', got {text!r}")
    try:
        value = parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"needs a positive size, e.g. '80GiB', got {text!r}")
    return value


def _add_memory(subparsers) -> None:
    p = subparsers.add_parser("memory", help="KV-cache bytes for a config: per token, per sequence, total")
    p.add_argument("config", help="preset name (llama-3-70b, llama-2-7b, deepseek-v2, deepseek-v3, smollm2-135m), "
                                  "a config.json path or a local model directory")
    p.add_argument("--seq-len", type=_count(1), default=4096)
    p.add_argument("--batch", type=_count(1), default=1)
    p.add_argument("--dtype", default="fp16", choices=_DTYPE_NAMES)
    p.add_argument("--bits", type=int, default=None, choices=(2, 4, 8), help="group-quantized code bits")
    p.add_argument("--group-size", type=_count(1), default=None, help="with --bits (default 64)")
    p.add_argument("--residual-length", type=_count(0), default=None, help="with --bits (default 0)")
    p.add_argument("--budget", type=_byte_size, default=None,
                   help="memory budget, e.g. 80GiB: prints the max batch after weights")
    p.set_defaults(func=_run_memory, check=functools.partial(_check_memory, p))


def _check_memory(parser, args) -> None:
    if args.bits is None:
        given = [flag for flag, value in (("--group-size", args.group_size), ("--residual-length",
                                                                                args.residual_length)) if value is not None]
        if given:
            parser.error(f"{' and '.join(given)} set the quantized layout; add --bits 2, 4 or 8 (or drop them).")
        return
    args.group_size = 64 if args.group_size is None else args.group_size
    args.residual_length = 0 if args.residual_length is None else args.residual_length
    from hf_kvspec.memory import check_quant_params

    try:
        check_quant_params(args.bits, args.group_size, args.residual_length)
    except ValueError as err:
        parser.error(str(err))


def _run_memory(args) -> None:
    from hf_kvspec.memory import format_bytes, kv_cache_bytes, max_batch_size, parameter_bytes
    from hf_kvspec.presets import load_config

    config = load_config(args.config)
    quant = {}
    if args.bits is not None:
        quant = {"bits": args.bits, "group_size": args.group_size, "residual_length": args.residual_length}
    per_seq = kv_cache_bytes(config, args.seq_len, 1, args.dtype, **quant)
    # quantized storage has no per-token size of its own (groups, residual window): report the average
    per_token = kv_cache_bytes(config, 1, 1, args.dtype) if args.bits is None else per_seq / args.seq_len
    storage = f"{args.bits}-bit, group {args.group_size}" if args.bits else args.dtype
    print(f"{args.config}: {config.num_hidden_layers} layers, KV storage {storage}")
    print(f"  per token:    {format_bytes(per_token)} ({per_token:,.0f} B)")
    print(f"  per sequence: {format_bytes(per_seq)} ({per_seq:,} B) at {args.seq_len} tokens")
    print(f"  total:        {format_bytes(per_seq * args.batch)} ({per_seq * args.batch:,} B) for batch {args.batch}")
    if args.budget:
        weights = parameter_bytes(config, args.dtype if args.dtype != "fp8" else "fp16")
        best = max_batch_size(config, args.seq_len, args.budget, args.dtype, weight_bytes=weights, **quant)
        note = "; the weights alone exceed the budget" if weights > args.budget else ""
        print(f"  budget {format_bytes(args.budget)}: weights {format_bytes(weights)}, "
              f"max batch {best} at {args.seq_len} tokens{note}")


def _add_generate(subparsers) -> None:
    from hf_kvspec.cache.factory import CACHE_CHOICES
    from hf_kvspec.speculative.assistants import ASSISTANT_HELP, HEAD_ASSISTANTS, TREES

    p = subparsers.add_parser("generate", help="stream an answer from the bundled model, then print stats")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=_count(1), default=128)
    p.add_argument("--cache", default="dynamic", choices=CACHE_CHOICES)
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    p.add_argument("--model", default="smollm2-135m-instruct", help="bundled model name")
    p.add_argument("--threads", type=_count(1), default=2)
    p.add_argument("--no-chat", action="store_true", help="feed the prompt raw, without the chat template")
    p.add_argument("--assistant", default=None,
                   help=f"speculative decoding drafter: {' | '.join(HEAD_ASSISTANTS)} (the bundled trained heads) | "
                        f"{ASSISTANT_HELP}")
    p.add_argument("--num-draft-tokens", type=_draft_tokens, default=None,
                   help="with --assistant: draft tokens per round (K; tree nodes for medusa/eagle), or 'auto' "
                        "(default 4; medusa/eagle/lookahead: auto)")
    p.add_argument("--tree", default=None, choices=TREES,
                   help="with --assistant medusa|eagle: static tree (default, small), chain, or EAGLE-2 dynamic "
                        "(default: medusa small, eagle dynamic)")
    p.add_argument("--draft-vocab-size", type=_vocab_size, default=None,
                   help="with --assistant medusa|eagle: draft only the N most frequent tokens (FR-Spec; exact), or "
                        "'full'; default: the heads' shipped draft vocabulary (4096 tokens)")
    p.add_argument("--compare-plain", action="store_true",
                   help="with --assistant: also decode plainly and print a side-by-side table (tokens/s, tau, "
                        "per-depth acceptance, identical output)")
    kernels = p.add_mutually_exclusive_group()
    kernels.add_argument("--decode-kernels", action="store_true",
                         help="with --assistant: hf_kvspec's measured CPU decode kernels for small-row linear calls "
                              "(the default on CPU; same results up to rounding; keeps weight copies)")
    kernels.add_argument("--stock-kernels", action="store_true",
                         help="with --assistant: torch's stock linear kernels (the reference path)")
    p.add_argument("--reference-forward", action="store_true",
                   help="run the model's own forward instead of hf_kvspec's fast forward (packed weight copies, "
                        "on by default for fp32 Llama-family models with --cache dynamic; same results up to "
                        "rounding)")
    p.set_defaults(func=_run_generate, check=functools.partial(_check_generate, p))


def _check_generate(parser, args) -> None:
    from hf_kvspec.speculative.assistants import HEAD_ASSISTANTS

    heads = args.assistant in HEAD_ASSISTANTS
    if args.assistant is None:
        given = [flag for flag, on in (("--num-draft-tokens", args.num_draft_tokens is not None),
                                       ("--decode-kernels", args.decode_kernels),
                                       ("--stock-kernels", args.stock_kernels),
                                       ("--compare-plain", args.compare_plain)) if on]
        if given:
            parser.error(f"{' and '.join(given)} apply to speculative decoding; add --assistant "
                         "(e.g. --assistant eagle) or drop them.")
    else:
        problem = _head_problem(args) if heads else _assistant_problem(args.assistant)
        if problem:
            parser.error(f"--assistant: {problem}")
    if not heads:
        given = [flag for flag, on in (("--tree", args.tree is not None),
                                       ("--draft-vocab-size", args.draft_vocab_size is not None)) if on]
        if given:
            parser.error(f"{' and '.join(given)} apply to the bundled heads; add --assistant medusa or "
                         "--assistant eagle, or drop them.")
    if args.num_draft_tokens is None and not heads and args.assistant is not None:
        from hf_kvspec.speculative.assistants import default_draft_tokens

        args.num_draft_tokens = default_draft_tokens(args.assistant)
    from hf_kvspec.models import BUNDLED_MODELS

    if args.model not in BUNDLED_MODELS:
        parser.error(f"--model {args.model!r} is not a bundled model; choose one of {', '.join(BUNDLED_MODELS)}.")


def _head_problem(args) -> str | None:
    """What is wrong with ``--assistant medusa|eagle`` and its tree options (``assistants.check_head_options``)."""
    from hf_kvspec.speculative.assistants import check_head_options

    try:
        check_head_options(args.assistant, args.tree, args.draft_vocab_size)
    except ValueError as err:
        return str(err)
    return None


def _assistant_problem(spec: str) -> str | None:
    """What is wrong with an ``--assistant`` spec that can be told without the model (``assistants.check_spec``)."""
    from hf_kvspec.speculative.assistants import check_spec

    try:
        check_spec(spec)
    except (TypeError, ValueError) as err:
        return str(err)
    return None


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> dict:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    return tokenizer(prompt, return_tensors="pt")


def _run_generate(args) -> None:
    import torch
    from transformers import TextStreamer

    from hf_kvspec.cache.factory import cache_nbytes, enable_cache_attention, make_cache
    from hf_kvspec.models import load_bundled_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_bundled_model(args.model)
    inputs = _prompt_ids(tokenizer, args.prompt, chat=not args.no_chat)
    enable_cache_attention(args.cache, model)  # e.g. kivi4 attends on its codes instead of dequantizing per step
    speculative = _speculative_kwargs(args, model)
    tokens = cache_tokens(inputs["input_ids"].shape[1], args.max_new_tokens, speculative["assistant"])
    cache = make_cache(args.cache, model.config, max_tokens=tokens)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    fast = _pack_fast_forward(model, speculative, args.cache, plain_too=args.compare_plain)
    _calibrate_kernels(model, speculative, target_routed=not fast)
    plain = None
    if args.compare_plain:  # first, so both runs find the model warm
        print("plain decoding (reference, not shown) ...", flush=True)
        fresh = make_cache(args.cache, model.config, max_tokens=tokens)
        plain = _timed(model, inputs, fresh, args.max_new_tokens, sampling, {**speculative, "assistant": None})
    out, elapsed = _timed(model, inputs, cache, args.max_new_tokens, sampling, speculative, streamer=streamer)
    new_tokens = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    _print_stats(new_tokens, elapsed, kv_bytes=cache_nbytes(out.cache or cache), cache_name=args.cache,
                 acceptance=out.acceptance if args.assistant is not None else None,
                 forward=out.acceptance.forward)
    if plain is not None:
        _print_comparison(args.assistant, out, elapsed, *plain, inputs["input_ids"].shape[1],
                          greedy=not sampling["do_sample"])


def cache_tokens(prompt_len: int, max_new_tokens: int, assistant=None) -> int:
    """Positions a row's cache must hold at once (what sizes ``--cache paged``'s pool): the prompt and the answer,
    plus, for an assistant that verifies trees, a last round's whole tree (the loop cuts a tree's depth near
    ``max_new_tokens``, not its width: ``max_draft_tokens`` nodes after up to ``max_length - 1`` committed tokens)."""
    extra = assistant.max_draft_tokens if assistant is not None and assistant.proposes_trees else 0
    return prompt_len + max_new_tokens + extra


def _calibrate_kernels(model, speculative: dict, target_routed: bool) -> None:
    """Time the decode kernels for this machine before anything is timed (once: the choices are stored), for the
    modules the call routes through them: the drafter's, and the target's only where the fast forward does not run
    it (settling a layer makes its weight copy, which the fast forward's own packed copy makes useless)."""
    from torch import nn

    from hf_kvspec.forward.runner import kernels_apply

    assistant = speculative["assistant"]
    if assistant is None or speculative["decode_kernels"] is False or not kernels_apply(model):
        return
    modules = [m for m in assistant.kernel_modules() if isinstance(m, nn.Module)]
    modules += [model] if target_routed else []
    if not modules:
        return
    from hf_kvspec.kernels.linear import DecodeKernels, default_plans_file

    with DecodeKernels(*modules, plans_file=default_plans_file(), route_on_enter=False) as kernels:
        seconds = kernels.calibrate(max_rows=32)
    if seconds > 0:
        print(f"calibrated the decode kernels for this machine in {seconds:.1f} s (stored; done once)", flush=True)


def _pack_fast_forward(model, speculative: dict, cache_name: str, plain_too: bool = False) -> bool:
    """Pack the fast forward's weight copies before anything is timed (once per process), and say so, when a
    timed call will run it (the speculative one, or with ``plain_too`` the plain reference); returns whether the
    speculative call runs the target on it (a self-drafter runs the target's layers itself)."""
    from hf_kvspec.forward.runner import FastForward, fast_forward_applies

    if cache_name != "dynamic" or speculative["fast_forward"] is False or not fast_forward_applies(model):
        return False
    assistant = speculative["assistant"]
    runs_fast = assistant is None or not assistant.runs_verify_forward
    if runs_fast or plain_too:
        seconds = FastForward(model).pack_s
        if seconds > 0:
            print(f"packed the weights for the fast forward in {seconds:.1f} s (once per process)", flush=True)
    return runs_fast


def _timed(model, inputs, cache, max_new_tokens, sampling, speculative, streamer=None):
    """One ``generate`` call -> (output, seconds)."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens, streamer=streamer,
                             return_dict_in_generate=True, **sampling, **speculative)
    return out, time.perf_counter() - start


def _print_comparison(name, out, elapsed, plain_out, plain_elapsed, prompt_len, greedy) -> None:
    """Side-by-side table: plain decoding vs the assistant on the same prompt."""
    stats = out.acceptance
    new, plain_new = out.sequences.shape[1] - prompt_len, plain_out.sequences.shape[1] - prompt_len
    same = "yes" if out.sequences.tolist() == plain_out.sequences.tolist() else "no"
    rows = [
        ("", "plain", name),
        ("new tokens", f"{plain_new}", f"{new}"),
        ("seconds", f"{plain_elapsed:.2f}", f"{elapsed:.2f}"),
        ("tokens/s", f"{plain_new / plain_elapsed:.2f}", f"{new / elapsed:.2f}"),
        ("speed-up", "1.00x", f"{(new / elapsed) / (plain_new / plain_elapsed):.2f}x"),
        ("tau (tokens per target forward)", "1.00", f"{stats.tokens_per_target_forward:.2f}"),
        ("acceptance per depth", "-", " ".join(f"{r:.2f}" for r in stats.acceptance_rate) or "-"),
        ("identical output", "-", same if greedy else f"{same} (sampled: differs by chance)"),
    ]
    left = max(len(r[0]) for r in rows)
    middle = max(len(r[1]) for r in rows)
    print()
    for key, a, b in rows:
        print(f"{key:<{left}}  {a:>{middle}}  {b}")


def _speculative_kwargs(args, model) -> dict:
    """``generate`` kwargs: hf_kvspec's loop (plain decoding without ``--assistant``) on the fast forward unless
    ``--reference-forward``."""
    from hf_kvspec.speculative.assistants import (
        HEAD_ASSISTANTS,
        default_draft_tokens,
        make_assistant,
        make_head_assistant,
    )
    from hf_kvspec.speculative.loop import speculative_generate

    fast_forward = False if args.reference_forward else None
    if args.assistant is None:
        return {"custom_generate": speculative_generate, "assistant": None, "fast_forward": fast_forward}
    if args.assistant in HEAD_ASSISTANTS:
        assistant = make_head_assistant(args.assistant, model, args.tree, args.num_draft_tokens, args.draft_vocab_size)
    else:
        count = default_draft_tokens(args.assistant) if args.num_draft_tokens is None else args.num_draft_tokens
        assistant = make_assistant(args.assistant, model, count)
    decode_kernels = True if args.decode_kernels else False if args.stock_kernels else None  # None: on where it helps
    return {"custom_generate": speculative_generate, "assistant": assistant, "decode_kernels": decode_kernels,
            "fast_forward": fast_forward}


def _print_stats(new_tokens: int, elapsed: float, kv_bytes: int, cache_name: str, acceptance=None,
                 forward: dict | None = None) -> None:
    from hf_kvspec.memory import format_bytes

    # plain decoding: one target forward per token; speculative: measured by the loop
    tau = acceptance.tokens_per_target_forward if acceptance is not None else 1.0
    rows = [
        ("new tokens", f"{new_tokens}"),
        ("tokens/s", f"{new_tokens / elapsed:.2f}"),
        ("tokens per target forward", f"{tau:.2f}"),
        (f"KV bytes ({cache_name})", f"{format_bytes(kv_bytes)} ({kv_bytes:,} B)"),
    ]
    if forward is not None:
        rows.append(("target forward", _forward_line(forward)))
    if acceptance is not None and acceptance.drafter is not None:
        rows.append(("drafter", _forward_line(acceptance.drafter)))
    if acceptance is not None:
        rates = " ".join(f"{rate:.2f}" for rate in acceptance.acceptance_rate)
        rows += [
            ("target forwards", f"{acceptance.target_forwards} ({acceptance.rounds} rounds)"),
            ("draft forwards", f"{acceptance.draft_forwards}"),
            ("acceptance per position", rates or "-"),
            ("draft / verify time", f"{acceptance.draft_time_s:.2f} s / {acceptance.verify_time_s:.2f} s"),
        ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "-" * (width + 24))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _forward_line(report: dict) -> str:
    """``fast (packed fp32 copies 1.07 GiB, packed in 0.61 s)`` / ``eager (the model's own)``."""
    from hf_kvspec.memory import format_bytes

    if report.get("forward") != "fast":
        return "the model's own (reference)"
    return (f"fast ({report['weights']} copies {format_bytes(report['packed_bytes'])}, packed in "
            f"{report['pack_s']:.2f} s this call)")


def _add_export_heads(subparsers) -> None:
    p = subparsers.add_parser("export-heads", help="write a trained head in a serving layout (vLLM, SGLang)")
    p.add_argument("head_dir", help="directory of a head saved by scripts/train_drafter.py, or bundled:KIND for a "
                                    "head shipped with the package (bundled:medusa, bundled:eagle, ...)")
    p.add_argument("--format", required=True, choices=("speculators", "sglang", "vllm-medusa"),
                   help="speculators: vLLM via the speculators EAGLE-3 config; sglang: LlamaForCausalLMEagle3; "
                        "vllm-medusa: vLLM's Medusa model")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--base_model", default=None,
                   help="base model whose LM head the export stores (default: the head's recorded base model)")
    p.add_argument("--speculative_tokens", type=_count(1), default=5, help="speculators' greedy proposal length")
    p.set_defaults(func=_run_export_heads, check=lambda args: None)


def _run_export_heads(args) -> None:
    from hf_kvspec.heads.bundled import head_path
    from hf_kvspec.heads.export import export_head

    spec = _export_base_spec(args)  # every path checked before a model is loaded
    try:
        base = _load_base_model(spec)
    except OSError as err:
        raise ValueError(f"--base_model {spec!r} could not be loaded ({err}); pass a local model directory, a Hub "
                         "id, or bundled:NAME.") from None
    out = export_head(head_path(args.head_dir), args.format, args.out, base_model=base,
                      speculative_tokens=args.speculative_tokens)
    print(f"wrote {args.format} layout to {out}")


def _export_base_spec(args) -> str:
    """Check ``export-heads``' paths (head directory, ``--out``); return the base model to load."""
    import json
    from pathlib import Path

    from hf_kvspec.heads.bundled import head_path

    head, out = head_path(args.head_dir), Path(args.out)
    if not head.is_dir():
        raise ValueError(f"head directory {str(head)!r} is not a directory; pass the directory "
                         "scripts/train_drafter.py saved.")
    if not (head / "config.json").is_file():
        raise ValueError(f"{str(head)!r} holds no config.json; pass the directory scripts/train_drafter.py saved.")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; pass a directory (it is created if missing).")
    try:
        config = json.loads((head / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(head / 'config.json')!r} is not valid JSON ({err}).") from None
    spec = args.base_model or (config.get("base_model_name_or_path") if isinstance(config, dict) else None)
    if spec is None:
        raise ValueError("the head records no base model; pass --base_model <path or bundled:NAME>.")
    return spec


def _load_base_model(spec: str):
    if spec == "bundled" or spec.startswith("bundled:"):
        from hf_kvspec.models import DEFAULT_MODEL, load_bundled_model

        return load_bundled_model(spec.partition(":")[2] or DEFAULT_MODEL)[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec)


def _kv_budget(text: str) -> int | str:
    """``--kv-budget``: a plain integer is a block count, anything else a byte size (kept as text)."""
    if text.isdigit():
        return _count(1)(text)
    _byte_size(text)
    return text


def _add_batch(subparsers) -> None:
    p = subparsers.add_parser("batch", help="run a JSON Lines file of prompts through the continuous-batching Engine")
    p.add_argument("prompts", help="JSON Lines: one {\"prompt\" | \"messages\" | \"input_ids\": ...} per line "
                                   "(see docs/engine.md)")
    p.add_argument("--out", required=True, help="results, one JSON object per input line, written as each finishes "
                                                "(never the prompts file; an existing file needs --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue a partly written --out: run only the lines whose ids it does not hold yet")
    p.add_argument("--model", default="smollm2-135m-instruct", help="bundled model name")
    p.add_argument("--max-new-tokens", type=_count(1), default=128, help="default for lines that do not say")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="default for lines that do not say; 0 = greedy")
    p.add_argument("--kv-budget", type=_kv_budget, default="256MB",
                   help="KV cache: a byte size (e.g. 256MB) or a plain number of blocks")
    p.add_argument("--block-size", type=_count(1), default=16)
    p.add_argument("--max-tokens-per-round", type=_count(1), default=256, help="token budget of one forward")
    p.add_argument("--max-running", type=_count(1), default=16, help="requests running at once")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chat", action="store_true", help="feed \"prompt\" text raw, without the chat template")
    p.add_argument("--assistant", default=None,
                   help="speculative decoding inside the rounds: ngram | suffix (drafts from every earlier prompt "
                        "and output of the run) | eagle | medusa (the bundled heads) | self-int8 | self-int4 (drafts "
                        "from a quantized copy, batched across requests) | draft:<causal LM dir> | "
                        "draft:truncated:<N> | suffix+<one of these> (per request, whichever pays) | auto (suffix, "
                        "plus the bundled EAGLE head where it fits the model); each request's "
                        "drafts are chosen per round from load (none where drafting would not pay)")
    p.add_argument("--num-draft-tokens", type=_count(1), default=None,
                   help="with --assistant: drafts (tree nodes) per request per round at most (default: ngram and "
                        "draft models 4, eagle, medusa, suffix and self-int8 8); the token budget may grant fewer")
    _add_pool_options(p, shared_by_default=True)
    _add_reference_forward(p)
    p.add_argument("--threads", type=_count(1), default=2)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run_batch, check=functools.partial(_check_batch, p))


def _check_batch(parser, args) -> None:
    from hf_kvspec.models import BUNDLED_MODELS

    if args.model not in BUNDLED_MODELS:
        parser.error(f"--model {args.model!r} is not a bundled model; choose one of {', '.join(BUNDLED_MODELS)}.")
    if args.max_running > args.max_tokens_per_round:
        parser.error(f"--max-running {args.max_running} exceeds --max-tokens-per-round {args.max_tokens_per_round}: "
                     "every running request needs a token of each round.")
    if args.assistant is None and args.num_draft_tokens is not None:
        parser.error("--num-draft-tokens applies to speculative decoding; add --assistant (e.g. ngram) or drop it.")
    if args.assistant is not None:
        problem = engine_assistant_problem(args.assistant)
        if problem:
            parser.error(f"--assistant: {problem}")
    _check_pool_options(parser, args)
    from hf_kvspec.serving.offline import check_paths, read_requests

    try:  # every line and the output path, before the model loads
        check_paths(args.prompts, args.out, args.resume)
        args.requests = read_requests(args.prompts, _batch_defaults(args))
    except ValueError as err:
        parser.error(str(err))


def _batch_defaults(args) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}


def engine_assistant_problem(spec: str) -> str | None:
    """What is wrong with ``batch`` or ``serve --assistant`` before the model loads: the engine runs chain and tree drafters and
    quantized self-drafting, not self-speculation through the target's own layers (early exit, layer skip, sparse
    KV: they draft on a cache of their own request's, and the engine's is shared)."""
    from hf_kvspec.speculative.assistants import HEAD_ASSISTANTS

    if spec == "auto":  # the suffix pool, with the bundled EAGLE head where it fits the model
        return None
    if "+" in spec:
        parts = spec.split("+")
        if len(parts) != 2 or parts.count("suffix") != 1 or "self-int8" in parts or "self-int4" in parts:
            return f"{spec}: two assistants are suffix and one model drafter, e.g. suffix+eagle or suffix+ngram."
        return next(filter(None, map(engine_assistant_problem, parts)), None)
    if spec in HEAD_ASSISTANTS:
        return None
    problem = _assistant_problem(spec)
    if problem is None and spec.split(":")[0] in ("early_exit", "layer_skip", "sparse_kv"):
        return f"{spec} is self-speculation (it drafts on the target's own cache); the engine takes ngram, eagle, " \
               "medusa, self-int8, self-int4 or a draft model (draft:<dir>, draft:truncated:<N>)."
    return problem


def _run_batch(args) -> None:
    import torch

    from hf_kvspec.models import load_bundled_model
    from hf_kvspec.serving.engine import Engine
    from hf_kvspec.serving.offline import ResultWriter, finished_ids, run_requests

    done = finished_ids(args.out) if args.resume else set()
    requests = [r for r in args.requests if r["id"] not in done]  # checked by _check_batch, before the model
    torch.set_num_threads(args.threads)
    model, tokenizer = load_bundled_model(args.model)
    assistant, pool = _engine_assistant(args, model)
    engine = Engine(model, tokenizer, kv_budget=args.kv_budget, block_size=args.block_size,
                    max_tokens_per_round=args.max_tokens_per_round, max_running=args.max_running,
                    enable_prefix_caching=not args.no_prefix_caching, assistant=assistant,
                    num_draft_tokens=args.num_draft_tokens, fast_forward=False if args.reference_forward else None)
    started = time.perf_counter()
    with ResultWriter(args.out) as writer:
        try:
            results = run_requests(engine, requests, _batch_defaults(args), chat=not args.no_chat,
                                   progress_bar=not args.no_progress, on_result=writer)
        except KeyboardInterrupt:
            print(f"hf-kvspec: interrupted: {writer.count + len(done)} of {len(args.requests)} results are in "
                  f"{args.out}; run again with --resume to finish the rest.", file=sys.stderr)
            raise SystemExit(130) from None
    _print_batch_summary(args, engine, results, len(done), time.perf_counter() - started)
    if pool is not None and args.save_pool:
        print(f"suffix pool: {pool.save(args.save_pool)} sequences -> {args.save_pool}")


def _print_batch_summary(args, engine, results: list[dict], resumed: int, seconds: float) -> None:
    stats = engine.telemetry()
    tokens = sum(len(r["output_ids"]) for r in results)
    failed = sum(r["finish_reason"] == "error" for r in results)
    print(f"{len(results)} requests, {tokens} output tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} "
          f"tokens/s) -> {args.out}" + (f" ({resumed} already there)" if resumed else "")
          + (f"; {failed} failed (\"error\" in their lines)" if failed else ""))
    print(f"rounds {stats['rounds']}, tokens/forward {stats['tokens_per_forward']:.1f}, preemptions "
          f"{stats['preemptions']}, prefix hit rate {stats['prefix_hit_rate']:.0%}, mean block use "
          f"{stats['mean_block_utilization']:.0%}")
    if args.assistant is not None:
        rate = stats["acceptance_rate"]
        print(f"speculation ({args.assistant}): output tokens/forward {stats['output_tokens_per_forward']:.2f}, "
              f"draft tokens {stats['draft_tokens']}, acceptance {'n/a' if rate is None else f'{rate:.0%}'}")
    if "suffix_pool" in stats:
        pool = stats["suffix_pool"]
        print(f"suffix pool: {pool['sequences']} sequences, {pool['bytes'] / 2**20:.1f} of "
              f"{pool['max_bytes'] / 2**20:.0f} MiB, hit rate {pool['hit_rate']:.0%}, {pool['evictions']} evicted")


def _add_pool_options(p, shared_by_default: bool) -> None:
    p.add_argument("--pool-mib", type=_count(1), default=64,
                   help="with --assistant suffix: the suffix pool's memory budget in MiB (least recently used text "
                        "is evicted past it)")
    p.add_argument("--warm-pool", default=None, metavar="FILE",
                   help="with --assistant suffix: start the pool from a file: one --save-pool wrote, or an earlier "
                        "batch --out results file")
    if shared_by_default:
        p.add_argument("--save-pool", default=None, metavar="FILE",
                       help="with --assistant suffix: write the pool at the end (for a later --warm-pool)")
        p.add_argument("--separate-unsalted", action="store_true",
                       help="with --assistant suffix: requests without a \"salt\" draft from their own text only "
                            "(default: one run is one user's, so unsalted requests share the pool)")
    else:
        p.add_argument("--share-unsalted-pool", action="store_true",
                       help="with --assistant suffix: requests without a salt share one pool (only for a server "
                            "with a single user: a shared pool drafts one user's text for another); by default "
                            "each request without a salt drafts from its own text only")


def _check_pool_options(parser, args) -> None:
    uses_pool = args.assistant is not None and ("suffix" in args.assistant.split("+") or args.assistant == "auto")
    given = [flag for flag, value in (("--warm-pool", args.warm_pool), ("--save-pool", getattr(args, "save_pool", None)),
                                      ("--pool-mib", args.pool_mib != 64)) if value]
    if given and not uses_pool:
        parser.error(f"{' and '.join(given)} apply to the suffix pool; add --assistant suffix (or suffix+eagle) or "
                     "drop them.")
    if args.warm_pool is not None and not Path(args.warm_pool).is_file():
        parser.error(f"--warm-pool {args.warm_pool}: no such file.")


def _engine_assistant(args, model):
    """(the Engine's ``assistant``, the suffix pool or None): ``--assistant`` with the pool options applied."""
    spec = args.assistant
    if spec == "auto":
        from hf_kvspec.serving.round_drafts import auto_assistants

        parts = auto_assistants(model)
        spec = parts if isinstance(parts, str) else "+".join(parts)
    if spec is None or "suffix" not in spec.split("+"):
        return spec, None
    from hf_kvspec.serving.suffix_drafting import warm_pool
    from hf_kvspec.speculative.drafters.suffix import SuffixAssistant
    from hf_kvspec.speculative.suffix_pool import SuffixPool

    shared = not getattr(args, "separate_unsalted", True) or getattr(args, "share_unsalted_pool", False)
    pool = SuffixPool(max_bytes=args.pool_mib << 20, share_unsalted=shared)
    if args.warm_pool is not None:
        print(f"suffix pool: {warm_pool(pool, args.warm_pool)} sequences from {args.warm_pool}", file=sys.stderr)
    parts = [SuffixAssistant(pool=pool) if part == "suffix" else part for part in spec.split("+")]
    return (parts[0] if len(parts) == 1 else parts), pool


def _add_reference_forward(p) -> None:
    p.add_argument("--reference-forward", action="store_true",
                   help="the engine's rounds on the model's own forward instead of hf_kvspec's fast forward "
                        "(packed weight copies; on by default for fp32 Llama-family models; same results up to "
                        "rounding)")


def _add_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server on the continuous-batching Engine "
                                            "(docs/serve.md)")
    p.add_argument("model", nargs="?", default=None, help="a local model directory or Hub id (or use --bundled)")
    p.add_argument("--bundled", nargs="?", const="smollm2-135m-instruct", default=None, metavar="NAME",
                   help="serve a bundled model (default smollm2-135m-instruct)")
    p.add_argument("--assistant", default=None,
                   help="speculative decoding inside the engine: ngram | suffix | eagle | medusa | self-int8 | "
                        "draft:<dir> | suffix+<another> (docs/serve.md)")
    _add_pool_options(p, shared_by_default=False)
    _add_reference_forward(p)
    p.add_argument("--served-model-name", default=None, help="the id /v1/models lists (default: the model's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--kv-budget", type=_kv_budget, default="256MB",
                   help="KV cache: a byte size (e.g. 256MB) or a plain number of blocks")
    p.add_argument("--block-size", type=_count(1), default=16)
    p.add_argument("--max-tokens-per-round", type=_count(1), default=256, help="token budget of one forward")
    p.add_argument("--max-running", type=_count(1), default=16, help="requests running at once")
    p.add_argument("--max-queue", type=_count(1), default=256,
                   help="requests (choices) in the server at once, running or waiting; more get 429")
    p.add_argument("--drain-timeout", type=_count(0), default=300,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--max-body-bytes", type=_byte_size, default=4 * 2**20,
                   help="largest request body (e.g. 4MiB); a larger one gets 413")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=_count(1), default=2)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=_run_serve, check=functools.partial(_check_serve, p))


def _check_serve(parser, args) -> None:
    if (args.model is None) == (args.bundled is None):
        parser.error("give exactly one of MODEL (a model directory or Hub id) and --bundled [NAME].")
    if args.bundled is not None:
        from hf_kvspec.models import BUNDLED_MODELS

        if args.bundled not in BUNDLED_MODELS:
            parser.error(f"--bundled {args.bundled!r} is not a bundled model; choose one of "
                         f"{', '.join(BUNDLED_MODELS)}.")
    if args.max_running > args.max_tokens_per_round:
        parser.error(f"--max-running {args.max_running} exceeds --max-tokens-per-round {args.max_tokens_per_round}: "
                     "every running request needs a token of each round.")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        parser.error("serve needs the server extra: pip install 'hf-kvspec[serve]'.")
    if args.assistant is not None:
        problem = engine_assistant_problem(args.assistant)
        if problem:
            parser.error(f"--assistant: {problem}")
    _check_pool_options(parser, args)
    problem = _port_problem(args.host, args.port)
    if problem:
        parser.error(problem)


def _port_problem(host: str, port: int) -> str | None:
    """Bind ``host:port`` for a moment, so that a busy port or an unknown host fails before the model loads."""
    import socket

    try:
        with socket.create_server((host, port)):
            return None
    except OSError as err:
        return f"cannot listen on --host {host} --port {port}: {err.strerror or err}; choose another port."


def _run_serve(args) -> None:
    import torch

    from hf_kvspec.serving.engine import Engine
    from hf_kvspec.serving.server import ServerConfig, run_server

    torch.set_num_threads(args.threads)
    if args.bundled is not None:
        from hf_kvspec.models import load_bundled_model

        model, tokenizer = load_bundled_model(args.bundled)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    assistant, _ = _engine_assistant(args, model)
    engine_kwargs = {"assistant": assistant} if assistant is not None else {}
    engine = Engine(model, tokenizer, kv_budget=args.kv_budget, block_size=args.block_size,
                    max_tokens_per_round=args.max_tokens_per_round, max_running=args.max_running,
                    enable_prefix_caching=not args.no_prefix_caching,
                    fast_forward=False if args.reference_forward else None, **engine_kwargs)
    config = ServerConfig(model_name=args.served_model_name or args.bundled or args.model,
                          max_queue=args.max_queue, drain_timeout_s=float(args.drain_timeout),
                          max_body_bytes=args.max_body_bytes)
    run_server(engine, config, host=args.host, port=args.port, log_level=args.log_level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvspec", description="KV caches and speculative decoding for transformers")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_memory(subparsers)
    _add_export_heads(subparsers)
    _add_batch(subparsers)
    _add_serve(subparsers)
    return parser


def _refuse_negative_values(parser, argv: list[str]) -> None:
    """``--kv-budget -1GB``: argparse takes ``-1GB`` for an option and says only "expected one argument"; name the
    real problem instead (plain negative numbers like ``-1`` reach the argument's own check)."""
    for flag, value in itertools.pairwise(argv):
        if flag.startswith("--") and "=" not in flag and re.fullmatch(r"-\d[^ ]*", value) \
                and not re.fullmatch(r"-\d+|-\d*\.\d+", value):
            parser.error(f"{flag} {value}: needs a value >= 0; negative values are never valid here.")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    _refuse_negative_values(parser, argv)
    args = parser.parse_args(argv)
    args.check(args)  # a bad combination exits 2 here, before any config or model is loaded
    try:
        args.func(args)
    except (ValueError, RuntimeError) as err:  # user-facing errors: message, not traceback
        print(f"hf-kvspec: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
