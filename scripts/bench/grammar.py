"""Structured output on the bundled model: what the grammar's mask costs and whether speculation still pays.

    python scripts/benchmark.py --threads 1 grammar [--assistants ngram,eagle,suffix] [--max-new-tokens 160]

Eight chat prompts, each asking for a JSON object of its own schema (nested objects, enums, arrays, numbers),
decoded greedily by the engine one request at a time (C = 1): without a grammar, with it (``response_format``'s
``GrammarLogitsProcessor``), and with it plus each assistant. Per system: output tokens/s and its ratio to the
unconstrained engine, the mask's milliseconds per call and calls per output token (a verify row calls it once
per node), how many outputs parse and validate against their schema (``jsonschema``) and how many equal the
constrained engine's without an assistant (greedy: all of them must). Results:
``benchmarks/results/<name>.{json,md}``.
"""

from __future__ import annotations

import json
import time

from bench.harness import Report, load_average

COLUMNS = ["system", "grammar", "tokens", "tok_per_s", "vs_plain", "mask_ms_per_call", "calls_per_token", "mask_share",
           "valid", "same_as_grammar", "load_before", "load_after"]
_STR = {"type": "string", "maxLength": 40}
SCHEMAS = [
    ("a fictional person", {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "city": _STR}),
    ("a pizza order", {"size": {"enum": ["small", "medium", "large"]},
                       "toppings": {"type": "array", "items": _STR, "maxItems": 4}, "extra_cheese": {"type": "boolean"}}),
    ("today's weather in Paris", {"city": _STR, "temperature_c": {"type": "number"},
                                  "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}}),
    ("a book", {"title": _STR, "author": {"type": "object", "properties": {"first": _STR, "last": _STR},
                                          "required": ["first", "last"], "additionalProperties": False},
                "year": {"type": "integer"}}),
    ("a to-do list with three items", {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"task": _STR, "done": {"type": "boolean"}}, "required": ["task", "done"],
        "additionalProperties": False}}}),
    ("a product review", {"product": _STR, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                          "summary": _STR}),
    ("a meeting invitation", {"title": _STR, "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri"]},
                              "attendees": {"type": "array", "items": _STR, "maxItems": 3}}),
    ("a recipe name and its cooking time", {"recipe": _STR, "minutes": {"type": "integer", "minimum": 1}}),
]


def add_arguments(parser) -> None:
    parser.add_argument("--assistants", default="ngram,eagle,suffix", help="comma list of engine assistants")
    parser.add_argument("--max-new-tokens", type=int, default=160,
                        help="new tokens per request at most (a schema-valid object must fit)")
    parser.add_argument("--name", default="grammar", help="writes benchmarks/results/NAME.{json,md}")


def schema_of(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


class TimedGrammar:
    """A grammar processor that adds its calls' seconds to a shared tally."""

    def __init__(self, processor, tally: list):
        self.processor, self.tally = processor, tally

    def __call__(self, input_ids, scores):
        started = time.perf_counter()
        try:
            return self.processor(input_ids, scores)
        finally:
            self.tally[0] += time.perf_counter() - started
            self.tally[1] += 1


def run_system(model, tokenizer, assistant, grammar: bool, args) -> dict:
    """Each prompt alone through a fresh engine's rounds; outputs, seconds and the mask's tally."""
    from hf_kvspec import Engine
    from hf_kvspec.grammar import GrammarLogitsProcessor

    engine = Engine(model, tokenizer, kv_budget="128MB", **({} if assistant is None else {"assistant": assistant}))
    tally, outputs, seconds = [0.0, 0], [], 0.0
    for subject, properties in SCHEMAS:
        messages = [{"role": "user", "content": f"Describe {subject} as a JSON object with the fields "
                                                 f"{', '.join(properties)}."}]
        processors = [TimedGrammar(GrammarLogitsProcessor(tokenizer, json_schema=schema_of(properties)), tally)
                      ] if grammar else []
        request_id = engine.add_request(messages, max_new_tokens=args.max_new_tokens, logits_processor=processors)
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds += time.perf_counter() - started
        outputs.append(engine.get_output(request_id))
    return {"outputs": outputs, "seconds": seconds, "tally": tally}


def valid_count(outputs) -> int:
    import jsonschema

    count = 0
    for output, (_, properties) in zip(outputs, SCHEMAS):
        try:
            jsonschema.validate(json.loads(output.text), schema_of(properties))
        except (ValueError, jsonschema.ValidationError):
            continue
        count += 1
    return count


def run(args) -> None:
    from hf_kvspec import load_bundled_model
    from hf_kvspec.grammar import GrammarLogitsProcessor

    model, tokenizer = load_bundled_model()
    GrammarLogitsProcessor(tokenizer, json_object=True)(*_warm(tokenizer, model.config.vocab_size))  # built once
    report = Report(args.name, "Structured output: the grammar's cost, and speculation under it (bundled model, C = 1)",
                    COLUMNS, settings=vars(args) | {"schemas": len(SCHEMAS)})
    systems = [("engine", None, False), ("engine", None, True)]
    systems += [(f"engine+{spec}", spec, True) for spec in filter(None, args.assistants.split(","))]
    plain, constrained = None, None
    for name, assistant, grammar in systems:
        before = load_average()
        result = run_system(model, tokenizer, assistant, grammar, args)
        tokens = sum(len(o.output_ids) for o in result["outputs"])
        rate = tokens / result["seconds"]
        plain = plain or rate
        ids = [o.output_ids for o in result["outputs"]]
        if grammar and constrained is None:
            constrained = ids
        calls = result["tally"][1]
        report.add(system=name, grammar=grammar, tokens=tokens, tok_per_s=round(rate, 2),
                   vs_plain=round(rate / plain, 3),
                   mask_ms_per_call=round(1000 * result["tally"][0] / calls, 3) if calls else None,
                   calls_per_token=round(calls / tokens, 2) if calls else None,
                   mask_share=round(result["tally"][0] / result["seconds"], 4) if calls else None,
                   valid=f"{valid_count(result['outputs'])}/{len(SCHEMAS)}",
                   same_as_grammar=(f"{sum(a == b for a, b in zip(ids, constrained))}/{len(SCHEMAS)}"
                                    if grammar else None),
                   load_before=before, load_after=load_average())
    report.notes += ["tok_per_s: output tokens / seconds of the engine's rounds, prompts one at a time; vs_plain: "
                     "over the engine without a grammar; mask_ms_per_call: the grammar processor's own time per "
                     "call (matcher catch-up, mask, -inf fill); calls_per_token: calls per output token (a verify "
                     "row scores every node); mask_share: the mask's share of the rounds' seconds (the rest of "
                     "vs_plain is the outputs' lengths: constrained answers are shorter, so prefill weighs more); "
                     "valid: outputs that parse and validate; same_as_grammar: outputs "
                     "equal to the constrained engine's without an assistant (greedy must give all)."]
    report.write()


def _warm(tokenizer, vocab_size: int):
    import torch

    return torch.tensor([tokenizer("{}")["input_ids"]]), torch.zeros(1, vocab_size)
