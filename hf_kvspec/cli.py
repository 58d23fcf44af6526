"""``hf-kvspec`` command line: ``generate`` on the bundled model and ``memory`` arithmetic.

Boundary: argument parsing and printing only; every computation lives in the library.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_kvspec.memory import format_bytes


def _add_memory(subparsers) -> None:
    p = subparsers.add_parser("memory", help="KV-cache bytes for a config: per token, per sequence, total")
    p.add_argument("config", help="preset name (llama-3-70b, llama-2-7b, deepseek-v2, deepseek-v3, smollm2-135m), "
                                  "a config.json path or a local model directory")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp16", choices=sorted(_DTYPES))
    p.add_argument("--bits", type=int, default=None, choices=(2, 4, 8), help="group-quantized code bits")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--residual-length", type=int, default=0)
    p.add_argument("--budget", default=None, help="memory budget, e.g. 80GiB: prints the max batch after weights")
    p.set_defaults(func=_run_memory)


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _run_memory(args) -> None:
    from hf_kvspec.memory import kv_cache_bytes, max_batch_size, parameter_bytes, parse_bytes
    from hf_kvspec.presets import load_config

    config = load_config(args.config)
    dtype = _DTYPES[args.dtype]
    quant = {"bits": args.bits, "group_size": args.group_size, "residual_length": args.residual_length}
    per_seq = kv_cache_bytes(config, args.seq_len, 1, dtype, **quant)
    # quantized storage has no per-token size of its own (groups, residual window): report the average
    per_token = kv_cache_bytes(config, 1, 1, dtype) if args.bits is None else per_seq / max(args.seq_len, 1)
    storage = f"{args.bits}-bit, group {args.group_size}" if args.bits else args.dtype
    print(f"{args.config}: {config.num_hidden_layers} layers, KV storage {storage}")
    print(f"  per token:    {format_bytes(per_token)} ({per_token:,.0f} B)")
    print(f"  per sequence: {format_bytes(per_seq)} ({per_seq:,} B) at {args.seq_len} tokens")
    print(f"  total:        {format_bytes(per_seq * args.batch)} ({per_seq * args.batch:,} B) for batch {args.batch}")
    if args.budget:
        weights = parameter_bytes(config, dtype if args.dtype != "fp8" else torch.float16)
        budget = parse_bytes(args.budget)
        best = max_batch_size(config, args.seq_len, budget, dtype, weight_bytes=weights, **quant)
        print(f"  budget {format_bytes(budget)}: weights {format_bytes(weights)}, "
              f"max batch {best} at {args.seq_len} tokens")


def _add_generate(subparsers) -> None:
    from hf_kvspec.cache.factory import CACHE_CHOICES

    p = subparsers.add_parser("generate", help="stream an answer from the bundled model, then print stats")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cache", default="dynamic", choices=CACHE_CHOICES)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--model", default="smollm2-135m-instruct", help="bundled model name")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-chat", action="store_true", help="feed the prompt raw, without the chat template")
    p.add_argument("--assistant", default=None,
                   help="speculative decoding drafter: ngram | draft:<causal LM dir> | draft:truncated:<N layers>")
    p.add_argument("--num-draft-tokens", default="4", help="draft tokens per round (K), or 'auto'")
    p.add_argument("--stock-kernels", action="store_true",
                   help="with --assistant: keep torch's stock linear kernels instead of hf_kvspec's measured "
                        "decode kernels (same results up to rounding; no weight copies)")
    p.set_defaults(func=_run_generate)


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> dict:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    return tokenizer(prompt, return_tensors="pt")


def _run_generate(args) -> None:
    from transformers import TextStreamer

    from hf_kvspec.cache.factory import cache_nbytes, enable_cache_attention, make_cache
    from hf_kvspec.models import load_bundled_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_bundled_model(args.model)
    inputs = _prompt_ids(tokenizer, args.prompt, chat=not args.no_chat)
    cache = make_cache(args.cache, model.config, max_tokens=inputs["input_ids"].shape[1] + args.max_new_tokens)
    enable_cache_attention(args.cache, model)  # e.g. kivi4 attends on its codes instead of dequantizing per step
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    speculative = _speculative_kwargs(args, model)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, cache=cache, max_new_tokens=args.max_new_tokens, streamer=streamer,
                             return_dict_in_generate=True, **sampling, **speculative)
    elapsed = time.perf_counter() - start
    new_tokens = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    _print_stats(new_tokens, elapsed, kv_bytes=cache_nbytes(out.cache or cache), cache_name=args.cache,
                 acceptance=getattr(out, "acceptance", None))


def _speculative_kwargs(args, model) -> dict:
    if args.assistant is None:
        return {}
    from hf_kvspec.speculative.assistants import make_assistant, parse_num_draft_tokens
    from hf_kvspec.speculative.loop import speculative_generate

    assistant = make_assistant(args.assistant, model, parse_num_draft_tokens(args.num_draft_tokens))
    return {"custom_generate": speculative_generate, "assistant": assistant, "decode_kernels": not args.stock_kernels}


def _print_stats(new_tokens: int, elapsed: float, kv_bytes: int, cache_name: str, acceptance=None) -> None:
    # plain decoding: one target forward per token; speculative: measured by the loop
    tau = acceptance.tokens_per_target_forward if acceptance is not None else 1.0
    rows = [
        ("new tokens", f"{new_tokens}"),
        ("tokens/s", f"{new_tokens / elapsed:.2f}"),
        ("tokens per target forward", f"{tau:.2f}"),
        (f"KV bytes ({cache_name})", f"{format_bytes(kv_bytes)} ({kv_bytes:,} B)"),
    ]
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvspec", description="KV caches and speculative decoding for transformers")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_memory(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, RuntimeError) as err:  # user-facing errors: message, not traceback
        print(f"hf-kvspec: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
