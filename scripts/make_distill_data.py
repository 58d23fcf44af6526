"""Write diverse self-distilled chat data for training draft heads: self-instruct requests written by the target,
reading tasks over offline corpora, greedy and sampled answers, follow-up turns (``hf_kvspec.heads.self_instruct``).

Run (the bundled model, one CPU thread; generation is cached, so an interrupted run continues where it stopped):

    python scripts/make_distill_data.py --base_model bundled --num_requests 200 --num_reading 100 \
        --output runs/drafter_data/distill_chats.jsonl --num_threads 1

    python scripts/make_distill_data.py --base_model bundled --max_items 64 ...   # stop after ~64 new items
    python scripts/make_distill_data.py --num_requests 0 --num_reading 0 --no_sampled_answers \
        --prompts scripts/train_configs/chat_prompts_train_large.jsonl --prompts_start 0 --num_prompts 2000 ...
                                    # answer 2,000 rows of a prompts file (the next run: --prompts_start 2000)
    python scripts/make_distill_data.py --base_model bundled --sample 50 --sample_output \
        scripts/train_configs/distill_chats_sample.jsonl ...                      # also keep a small sample

Writes ``--output`` (JSONL, one chat per line: ``messages``, ``source``, ``answer``) and ``<output>.recipe.json``
(settings, counts, duplicate rate), which ``scripts/train_drafter.py --dataset <output>`` reads and puts in the
model card. Every user turn is checked against ``--held_out`` (prompts, topics, templates) before anything is
written; leaking candidates are dropped during generation and counted in the recipe.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_drafter import load_target  # noqa: E402  (same loading rules as the trainer)

from hf_kvspec.heads.data import HeldOut  # noqa: E402
from hf_kvspec.heads.pairing import base_model_fingerprint  # noqa: E402
from hf_kvspec.heads.self_instruct import RecipeSettings, build_distill_data, write_data  # noqa: E402


@dataclass
class Arguments:
    base_model: str = field(default="bundled", metadata={"help": "bundled[:NAME], a local path or a Hub id"})
    output: str = "runs/drafter_data/distill_chats.jsonl"
    cache_file: str | None = field(default=None, metadata={"help": "default: <output>.cache.jsonl"})
    held_out: str = str(HERE / "train_configs" / "chat_prompts_heldout.jsonl")
    seed: int = 0
    num_requests: int = 200
    num_reading: int = 100
    corpora: list[str] = field(default_factory=lambda: ["python-docs", "python-stdlib"])
    follow_up_fraction: float = 0.5
    sampled_answers: bool = True
    request_temperature: float = 1.0
    answer_temperature: float = 0.7
    request_max_new_tokens: int = 40
    answer_max_new_tokens: int = 128
    batch_size: int = 16
    tasks: list[str] | None = field(default=None, metadata={
        "help": "seed tasks of the self-instruct requests (default: all), e.g. explanation comparison definition "
                "for long explanatory answers"})
    prompts: str | None = field(default=None, metadata={
        "help": "also answer the rows of this prompts file (JSONL 'prompt' column, or one per line)"})
    prompts_start: int = field(default=0, metadata={
        "help": "answer the file's rows [start, start + num_prompts) in an order shuffled by --seed"})
    num_prompts: int | None = field(default=None, metadata={"help": "default: every row from --prompts_start on"})
    max_items: int | None = field(default=None, metadata={"help": "stop after about this many new generations"})
    num_threads: int | None = None
    device: str | None = field(default=None, metadata={"help": "default: cuda when available, else cpu"})
    sample: int = field(default=0, metadata={"help": "also write this many random rows to --sample_output"})
    sample_output: str | None = None


def _portable(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (recipes go into committed cards)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else path


def settings_from(args: Arguments) -> RecipeSettings:
    return RecipeSettings(seed=args.seed, num_requests=args.num_requests, num_reading=args.num_reading,
                          corpora=tuple(args.corpora), follow_up_fraction=args.follow_up_fraction,
                          sampled_answers=args.sampled_answers, request_temperature=args.request_temperature,
                          answer_temperature=args.answer_temperature,
                          request_max_new_tokens=args.request_max_new_tokens,
                          answer_max_new_tokens=args.answer_max_new_tokens, batch_size=args.batch_size,
                          tasks=tuple(args.tasks) if args.tasks else None,
                          prompts=_portable(args.prompts) if args.prompts else None,
                          prompts_start=args.prompts_start, num_prompts=args.num_prompts)


def parse_arguments(argv: list[str] | None) -> Arguments:
    """The command line as ``Arguments``; anything that cannot work exits 2 here, before the model loads."""
    parser = HfArgumentParser(Arguments)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    problems = argument_problems(args)
    if problems:
        parser.error("\n  ".join(problems))
    return args


def argument_problems(args: Arguments) -> list[str]:
    """Each unusable argument with its fix."""
    from hf_kvspec.heads.reading_tasks import CORPORA

    problems = [f"--{flag} {value}: needs an int >= 1" for flag, value in (
        ("batch_size", args.batch_size),
        ("request_max_new_tokens", args.request_max_new_tokens), ("answer_max_new_tokens", args.answer_max_new_tokens))
        if value < 1]
    problems += [f"--{flag} {value}: needs an int >= 1, or leave it unset" for flag, value in (
        ("max_items", args.max_items), ("num_threads", args.num_threads), ("num_prompts", args.num_prompts))
        if value is not None and value < 1]
    problems += [f"--{flag} {value}: needs an int >= 0" for flag, value in (
        ("num_requests", args.num_requests), ("num_reading", args.num_reading), ("sample", args.sample),
        ("prompts_start", args.prompts_start)) if value < 0]
    problems += prompts_problems(args)
    if not 0 <= args.follow_up_fraction <= 1:
        problems.append(f"--follow_up_fraction {args.follow_up_fraction}: needs a share in 0..1 of the kept requests")
    problems += [f"--{flag} {value}: needs a number > 0 (sampling temperature)" for flag, value in (
        ("request_temperature", args.request_temperature), ("answer_temperature", args.answer_temperature))
        if not value > 0]
    unknown = [c for c in args.corpora if c not in CORPORA]
    if args.num_reading and (unknown or not args.corpora):
        problems.append(f"--corpora {unknown or args.corpora}: known corpora are {', '.join(CORPORA)}")
    if args.tasks is not None:
        from hf_kvspec.heads.self_instruct import check_tasks

        try:
            check_tasks(args.tasks)
        except ValueError as err:
            problems.append(f"--{err}")
    if not Path(args.held_out).is_file():
        problems.append(f"--held_out {args.held_out}: no such file (the prompts training must not see)")
    if args.sample and not args.sample_output:
        problems.append(f"--sample {args.sample} needs --sample_output FILE (or drop --sample)")
    return problems


def prompts_problems(args: Arguments) -> list[str]:
    """The prompts file and its slice, and that some source is asked for at all."""
    if args.prompts is None:
        if args.num_requests == 0 and args.num_reading == 0:
            return ["--num_requests 0 and --num_reading 0 leave nothing to answer: ask for requests, reading tasks "
                    "or --prompts FILE"]
        if args.num_prompts is not None or args.prompts_start:
            return ["--num_prompts / --prompts_start slice a prompts file: pass --prompts FILE as well"]
        return []
    if not Path(args.prompts).is_file():
        return [f"--prompts {args.prompts}: no such file"]
    from hf_kvspec.heads.data import read_prompts

    try:
        rows = len(read_prompts(args.prompts))
    except (KeyError, ValueError) as err:
        return [f"--prompts {args.prompts}: unreadable ({err!r}); give JSONL rows with a 'prompt' key, or a text "
                "file with one prompt per line"]
    if args.prompts_start >= rows:
        return [f"--prompts_start {args.prompts_start}: {args.prompts} has {rows} rows; start below that"]
    return []


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model, tokenizer, recorded, _ = load_target(args.base_model)
    model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    held_out = HeldOut.from_file(args.held_out)
    cache_file = args.cache_file or args.output + ".cache.jsonl"
    started = time.time()
    data = build_distill_data(model, tokenizer, cache_file, base_model_fingerprint(model), held_out,
                              settings_from(args), args.max_items)
    seconds = round(time.time() - started, 1)
    if not data.complete:
        print(f"stopped after --max_items {args.max_items} new generations ({seconds} s); run the same command "
              f"again to continue from {cache_file}")
        return 0
    data.recipe.update(base_model=recorded, held_out=_portable(args.held_out), seconds_this_run=seconds,
                       command="python scripts/make_distill_data.py " + " ".join(argv or sys.argv[1:]))
    write_data(data, args.output)
    if args.sample and args.sample_output:
        rows = random.Random(args.seed).sample(data.rows, min(args.sample, len(data.rows)))
        Path(args.sample_output).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(json.dumps({k: data.recipe[k] for k in ("self_instruct", "reading", "prompts", "follow_ups", "rows")
                      if k in data.recipe}, indent=1))
    print(f"{len(data.rows)} chats -> {args.output} ({seconds} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
