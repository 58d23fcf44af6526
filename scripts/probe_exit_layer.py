"""Choose the exit layer E of an early-exit adapter by measured acceptance x cost (a quick probe, CPU).

For each candidate E: train a small ``ExitAdapter`` for a fixed wall-clock budget on cached layer-E states of the
target's own answers (one target pass stores every candidate layer), then measure on held-out answers its
teacher-forced top-1 agreement and the greedy chain tau (``evaluate_exit_adapter``, exact for
greedy chains) at K drafts per round. The cost model counts weight bytes read per token at batch 1, in units of one decoder layer: a draft
token costs E + adapter + LM head, a verify forward L + LM head; the predicted speed of a K-draft round is
``tau / (1 + K * draft / verify)`` (verify cost taken as one forward, its best case on a memory-bound device).

Run (the training prompts must have been self-distilled into --data_cache_dir first, e.g. by train_drafter.py
--prepare_data_only; the probe uses the training answers cached so far)::

    python scripts/probe_exit_layer.py --layers 4 6 8 12 --seconds 75 --data_cache_dir runs/early_exit/cache \
        --output runs/early_exit/probe.json
    python scripts/probe_exit_layer.py --measure_adapter runs/smollm2-early-exit --output live_tau.json  # the loop
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_kvspec.heads import data as data_lib
from hf_kvspec.heads.configuration_exit import ExitAdapterConfig
from hf_kvspec.heads.distill import DistillSettings, self_distill
from hf_kvspec.heads.evaluation_exit import evaluate_exit_adapter
from hf_kvspec.heads.features import right_padded
from hf_kvspec.heads.modeling_exit import ExitAdapter, exit_loss
from hf_kvspec.heads.objectives import TrainingVocabulary
from hf_kvspec.heads.pairing import base_model_fingerprint
from hf_kvspec.models import load_bundled_model


@torch.no_grad()
def layer_states(target, conversations, layers: list[int], batch_size: int = 8) -> tuple[dict, torch.Tensor]:
    """{E: [N, H] float16 layer-E states} and [N] target greedy tokens over every real position."""
    states, tokens = {e: [] for e in layers}, []
    for start in range(0, len(conversations), batch_size):
        ids, valid = right_padded([c.input_ids for c in conversations[start:start + batch_size]])
        out = target(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True, use_cache=False)
        for e in layers:
            states[e].append(out.hidden_states[e][valid].half())
        tokens.append(out.logits.argmax(-1)[valid])
    return {e: torch.cat(s) for e, s in states.items()}, torch.cat(tokens)


def train_for(target, exit_layer: int, states: torch.Tensor, tokens: torch.Tensor, seconds: float,
              batch: int = 1024, lr: float = 1e-3) -> tuple[ExitAdapter, int]:
    adapter = ExitAdapter(ExitAdapterConfig.for_base_model(target, exit_layer=exit_layer)).attach(target)
    vocab = TrainingVocabulary(target.config.vocab_size, torch.unique(tokens))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=lr)
    gen, steps, started = torch.Generator().manual_seed(0), 0, time.time()
    while time.time() - started < seconds:
        pick = torch.randint(len(tokens), (batch,), generator=gen)
        out = exit_loss(adapter, {"features": states[pick][None].float(), "target_tokens": tokens[pick][None],
                                  "valid": torch.ones(1, batch, dtype=torch.bool)}, vocab)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return adapter.eval(), steps


def draft_cost(config, exit_layer: int, adapter_params: int) -> float:
    """Weight bytes per draft token / per verify forward (batch 1, memory-bound model; embeddings not read)."""
    layer = sum(p.numel() for p in config_layer_params(config))
    head = config.vocab_size * config.hidden_size
    return (exit_layer * layer + adapter_params + head) / (config.num_hidden_layers * layer + head)


def config_layer_params(config):
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    return [torch.empty(h, h), torch.empty(kv, h), torch.empty(kv, h), torch.empty(h, h), torch.empty(3 * i, h)]


def answered(target, tokenizer, prompts, cache: Path, fingerprint: str, settings) -> list:
    """The training prompts whose answers are already cached (a probe need not wait for all of them)."""
    from hf_kvspec.heads.distill import _key, _load_cache, chat_prompt_ids

    done = _load_cache(cache)
    ready = [p for p in prompts if _key(fingerprint, chat_prompt_ids(tokenizer, p), settings) in done]
    return self_distill(target, tokenizer, ready, cache, fingerprint, settings, progress=False)


@torch.no_grad()
def live_tau(target, tokenizer, adapter_dir: str, prompts: list[str], k: int, new_tokens: int) -> dict:
    """tau of ``EarlyExitAssistant(adapter)`` in the real decoding loop, greedy, bs 1, one run per prompt; the output
    is checked against plain greedy ``generate``."""
    import hf_kvspec

    adapter = ExitAdapter.from_pretrained(adapter_dir, dtype=torch.float32).eval()
    stats, identical = None, 0
    for prompt in prompts:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        out = target.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                              custom_generate=hf_kvspec.speculative_generate,
                              assistant=hf_kvspec.EarlyExitAssistant(None, num_draft_tokens=k, adapter=adapter))
        identical += int(torch.equal(out.sequences, target.generate(**inputs, max_new_tokens=new_tokens,
                                                                    do_sample=False)))
        stats = out.acceptance if stats is None else stats.merge(out.acceptance)
    return {"tau": stats.tokens_per_target_forward, "acceptance_rate": stats.acceptance_rate, "draft_k": k,
            "prompts": len(prompts), "max_new_tokens": new_tokens, "identical_to_plain": identical,
            "emitted_tokens": stats.emitted_tokens, "target_forwards": stats.target_forwards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 6, 8, 12])
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--draft_k", type=int, nargs="+", default=[4], help="drafts per round to score")
    parser.add_argument("--train_prompts", default="scripts/train_configs/chat_prompts_train.jsonl")
    parser.add_argument("--eval_prompts", default="scripts/train_configs/chat_prompts_heldout.jsonl")
    parser.add_argument("--data_cache_dir", default="runs/early_exit/cache")
    parser.add_argument("--output", default="runs/early_exit/probe.json")
    parser.add_argument("--measure_adapter", default=None,
                        help="instead of probing: tau of this saved adapter in the decoding loop on --eval_prompts")
    parser.add_argument("--new_tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_bundled_model()
    target.eval().requires_grad_(False)
    if args.measure_adapter:
        result = live_tau(target, tokenizer, args.measure_adapter, data_lib.read_prompts(args.eval_prompts),
                          args.draft_k[0], args.new_tokens)
        Path(args.output).write_text(json.dumps(result, indent=2))
        print(json.dumps(result))
        return
    settings, cache = DistillSettings(max_new_tokens=128, batch_size=16), Path(args.data_cache_dir) / "self_distill.jsonl"
    fingerprint = base_model_fingerprint(target)
    train = answered(target, tokenizer, data_lib.read_prompts(args.train_prompts), cache, fingerprint, settings)
    held = self_distill(target, tokenizer, data_lib.read_prompts(args.eval_prompts), cache, fingerprint, settings)
    print(f"{len(train)} training answers, {len(held)} held-out answers", flush=True)
    states, tokens = layer_states(target, train, args.layers)
    rows = []
    for e in args.layers:
        adapter, steps = train_for(target, e, states[e], tokens, args.seconds)
        params = sum(p.numel() for p in adapter.parameters())
        cost = draft_cost(target.config, e, params)
        result = {k: evaluate_exit_adapter(adapter, target, held, depth=k) for k in args.draft_k}
        taus = {k: r["tau"] for k, r in result.items()}
        rows.append({"exit_layer": e, "train_steps": steps, "train_positions": len(tokens),
                     "top1": result[args.draft_k[0]]["per_head_top1"][0], "tau": taus, "draft_cost": round(cost, 4),
                     "predicted_speed": {k: round(t / (1 + k * cost), 4) for k, t in taus.items()}})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.output).write_text(json.dumps({"seconds_per_layer": args.seconds, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
