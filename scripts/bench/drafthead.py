"""What an EAGLE head's draft vocabulary saves: training-step and draft-step time, full vocabulary vs N tokens.

    python scripts/benchmark.py drafthead [--draft-vocab-sizes 4096 8192] [--batch 16 --length 256 --unroll 4]

The bundled SmolLM2-135M-Instruct (H = 576, V = 49,152) and a head with the bundled EAGLE head's configuration,
random weights and inputs of real shapes (time does not depend on the values), fp32. Rows, each a ratio against
the full vocabulary measured in the same run:

- training step: forward + backward + AdamW of the unrolled EAGLE loss on a [batch, length] batch of cached features,
  for the full-vocabulary loss (the bundled heads' GPU recipe), a training softmax over the N most frequent labels
  (``--train_vocab_size N``; the head still drafts over all V) and a trained draft vocabulary (``--draft_vocab_size
  N``: the head's own [N, H] projection, also used when drafting);
- draft step: one head step (layer + projection + argmax) for 1 and 8 new nodes, also given in target one-token
  steps (a target forward of one token after ``--length`` cached tokens, timed in the same run).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from bench.harness import Report, measure
from hf_kvspec.heads.configuration import EagleConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.objectives import TrainingObjective, TrainingVocabulary
from hf_kvspec.heads.trained_vocab import HeadVocabulary, projection_cost


def add_arguments(parser) -> None:
    parser.add_argument("--draft-vocab-sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--unroll", type=int, default=4, help="training-time-test steps (bundled recipe: 4)")
    parser.add_argument("--repeats", type=int, default=5)


def _head(target, draft_vocab_size: int | None) -> EagleHead:
    torch.manual_seed(0)
    config = EagleConfig.for_base_model(target, "bundled", feature_layers=[-1], draft_vocab_size=draft_vocab_size)
    head = EagleHead(config).attach(target)
    if draft_vocab_size is not None:
        head.set_draft_vocab(torch.randperm(config.base_vocab_size)[:draft_vocab_size])
    return head


def _batch(args, vocab: int, hidden: int) -> dict:
    torch.manual_seed(1)
    shape = (args.batch, args.length)
    return {"input_ids": torch.randint(0, vocab, shape), "valid": torch.ones(shape, dtype=torch.bool),
            "target_tokens": torch.randint(0, vocab, shape), "features": torch.randn(*shape, hidden)}


def _train_step_seconds(args, head, vocab, batch) -> float:
    objective = TrainingObjective(head.train(), vocab, "target", args.unroll, 1.0, 0.8)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)

    def step():
        optimizer.zero_grad()
        objective(batch).loss.backward()
        optimizer.step()

    return measure(step, warmup=1, repeats=args.repeats).median_s


def _draft_step_seconds(args, head, nodes: int) -> float:
    ids = torch.randint(0, head.config.base_vocab_size, (1, nodes))
    features = torch.randn(1, nodes, head.config.base_hidden_size)

    @torch.inference_mode()
    def step():
        head.draft_to_target(head(ids, features=features).logits.argmax(-1))

    return measure(step, warmup=2, repeats=args.repeats * 4).median_s


def _target_step_seconds(args, target) -> float:
    cache = DynamicCache(config=target.config)
    with torch.inference_mode():
        target(torch.randint(0, target.config.vocab_size, (1, args.length)), cache=cache)

    @torch.inference_mode()
    def step():
        target(torch.randint(0, target.config.vocab_size, (1, 1)), cache=cache)
        cache.crop(-1)  # drop the token just added

    return measure(step, warmup=2, repeats=args.repeats * 4).median_s


def run(args) -> None:
    from hf_kvspec.models import load_bundled_model

    target, _ = load_bundled_model()
    target.eval().requires_grad_(False)
    vocab_size, hidden = target.config.vocab_size, target.config.hidden_size
    report = Report("drafthead", "EAGLE head: full vocabulary vs draft vocabulary (training step, draft step)",
                    ["what", "vocabulary", "seconds", "ratio_vs_full", "target_steps", "projection_flops_ratio"],
                    settings=vars(args))
    batch, target_step = _batch(args, vocab_size, hidden), _target_step_seconds(args, target)
    full_head = _head(target, None)
    full_train = _train_step_seconds(args, full_head, TrainingVocabulary(vocab_size), batch)
    report.add(what="training step", vocabulary=f"full {vocab_size}", seconds=full_train, ratio_vs_full=1.0)
    full_draft = {nodes: _draft_step_seconds(args, full_head, nodes) for nodes in (1, 8)}
    for nodes, seconds in full_draft.items():
        report.add(what=f"draft step, {nodes} node(s)", vocabulary=f"full {vocab_size}", seconds=seconds,
                   ratio_vs_full=1.0, target_steps=seconds / target_step)
    for size in args.draft_vocab_sizes:
        flops = round(1 / projection_cost(hidden, vocab_size, size)["saving"], 3)
        softmax_vocab = TrainingVocabulary(vocab_size, torch.arange(size))
        seconds = _train_step_seconds(args, _head(target, None), softmax_vocab, batch)
        report.add(what="training step", vocabulary=f"training softmax {size}", seconds=seconds,
                   ratio_vs_full=seconds / full_train, projection_flops_ratio=flops)
        head = _head(target, size)
        seconds = _train_step_seconds(args, head, HeadVocabulary(head), batch)
        report.add(what="training step", vocabulary=f"draft vocabulary {size}", seconds=seconds,
                   ratio_vs_full=seconds / full_train, projection_flops_ratio=flops)
        for nodes in (1, 8):
            seconds = _draft_step_seconds(args, head.eval(), nodes)
            report.add(what=f"draft step, {nodes} node(s)", vocabulary=f"draft vocabulary {size}", seconds=seconds,
                       ratio_vs_full=seconds / full_draft[nodes], target_steps=seconds / target_step,
                       projection_flops_ratio=flops)
    report.notes.append(f"Target one-token step after {args.length} cached tokens: {target_step * 1e3:.1f} ms "
                        "(the unit of target_steps).")
    report.write()
