"""Build the workloads of the suffix-pool benchmark: traffic that repeats itself across requests, and a control.

    python scripts/benchmark.py workloads          # writes benchmarks/workloads/<name>.jsonl (committed)

Each file holds 64 requests, one ``{"id", "messages"}`` per line, made here from fixed seeds (no one else's data):

    extraction   fill one JSON schema from a passage; the 64 passages are biographies the bundled model wrote
                 (greedy) from a name, age, job, city and hobby drawn from the lists below
    multiturn    a question, the bundled model's own answer (greedy), then a follow-up asking it to repeat or
                 revise that answer
    code_edit    a 40-line Python function built from the snippets below (names and steps drawn per function) with
                 an edit to make: rename a parameter, or add one, then show the whole function
    chat         varied single-turn chat prompts (the held-out chat set of the other benchmarks): the control

``load(name, count)`` reads the first ``count`` requests of a workload.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORKLOADS = ("extraction", "multiturn", "code_edit", "chat")
DIRECTORY = Path("benchmarks/workloads")
COUNT = 64

NAMES = ["Alice Moreau", "Bilal Khan", "Chen Wei", "Dara Okafor", "Elena Petrova", "Felix Braun", "Grace Lee",
         "Hugo Silva", "Ines Garcia", "Jonas Berg", "Kaya Yilmaz", "Liam Murphy", "Maya Cohen", "Nils Larsen",
         "Olga Novak", "Pedro Costa"]
JOBS = ["nurse", "carpenter", "software engineer", "teacher", "chef", "pilot", "librarian", "farmer"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Toronto", "Osaka", "Lyon", "Denver", "Krakow"]
HOBBIES = ["chess", "gardening", "running", "painting", "sailing", "baking", "birdwatching", "photography"]
SCHEMA = '{"name": "<string>", "age": <integer>, "job": "<string>", "city": "<string>", "hobby": "<string>"}'
TOPICS = ["photosynthesis", "the water cycle", "how vaccines work", "compound interest", "plate tectonics",
          "the French Revolution", "how a CPU executes instructions", "supply and demand", "black holes",
          "the immune system", "recycling plastics", "how airplanes fly", "the Pythagorean theorem", "climate change",
          "how the internet routes data", "the causes of seasons"]
FOLLOW_UPS = ["Repeat your answer above word for word.",
              "Repeat your answer above, but start it with a one-line title.",
              "Please say that again in the same words, then add one more sentence.",
              "Rewrite your answer above exactly, but as a bulleted list with one sentence per bullet."]
THINGS = ["orders", "readings", "invoices", "samples", "events", "payments", "sessions", "tickets"]
STEPS = [
    ["    cleaned = []", "    for record in records:", "        if record is None:", "            continue",
     "        value = float(record.get(\"value\", 0.0))", "        if value < threshold:", "            continue",
     "        cleaned.append(value)"],
    ["    counts = {}", "    for record in records:", "        key = record.get(\"kind\", \"unknown\")",
     "        counts[key] = counts.get(key, 0) + 1", "    if verbose:", "        for key, count in sorted(counts.items()):",
     "            print(f\"{key}: {count}\")"],
    ["    total = 0.0", "    largest = None", "    for value in cleaned:", "        total += value",
     "        if largest is None or value > largest:", "            largest = value",
     "    mean = total / len(cleaned) if cleaned else 0.0"],
    ["    spread = 0.0", "    for value in cleaned:", "        spread += (value - mean) ** 2",
     "    spread = (spread / len(cleaned)) ** 0.5 if cleaned else 0.0", "    if verbose:",
     "        print(f\"mean={mean:.3f} spread={spread:.3f}\")"],
    ["    flagged = [value for value in cleaned if value > mean + 2 * spread]", "    if flagged and verbose:",
     "        print(f\"{len(flagged)} outliers above {mean + 2 * spread:.3f}\")"],
]
EDITS = ["Rename the parameter `threshold` to `minimum` everywhere in this function, and show the whole function.",
         "Add a parameter `scale=1.0` after `threshold` and multiply each value by it when it is read; show the "
         "whole function.",
         "Rename the variable `cleaned` to `kept` everywhere in this function, and show the whole function.",
         "Add a docstring line under the signature that says what the function returns; show the whole function."]


def load(name: str, count: int) -> list[list[dict]]:
    """The first ``count`` requests (message lists) of workload ``name``."""
    if name not in WORKLOADS:
        raise ValueError(f"workloads are {', '.join(WORKLOADS)}; got {name!r}")
    path = DIRECTORY / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} is missing: run `python scripts/benchmark.py workloads` first.")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line["messages"] for line in lines[:count]]


def add_arguments(parser) -> None:
    parser.add_argument("--count", type=int, default=COUNT, help="requests per workload")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="length of the model-written texts")
    parser.set_defaults(func=run)


def run(args) -> None:
    from hf_kvspec import Engine
    from hf_kvspec.models import load_bundled_model

    model, tokenizer = load_bundled_model()
    engine = Engine(model, tokenizer, kv_budget="256MB", max_running=16)
    DIRECTORY.mkdir(parents=True, exist_ok=True)
    built = {"extraction": extraction(engine, args), "multiturn": multiturn(engine, args),
             "code_edit": code_edits(args.count), "chat": chat(args.count)}
    for name, requests in built.items():
        path = DIRECTORY / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in enumerate(requests)))
        print(f"{path}: {len(requests)} requests")


def _answers(engine, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    outputs = engine.generate_batch(conversations, max_new_tokens=max_new_tokens, progress_bar=True)
    return [out.text.strip() for out in outputs]


def extraction(engine, args) -> list[list[dict]]:
    rng = random.Random(0)
    people = [(rng.choice(NAMES), rng.randint(21, 70), rng.choice(JOBS), rng.choice(CITIES), rng.choice(HOBBIES))
              for _ in range(args.count)]
    asks = [[{"role": "user", "content": f"Write a three-sentence biography of {name}, a {age}-year-old {job} who "
                                         f"lives in {city} and loves {hobby}."}] for name, age, job, city, hobby in people]
    passages = _answers(engine, asks, args.max_new_tokens)
    return [[{"role": "user", "content": f"Read the passage and fill in this JSON object. Reply with the JSON only."
                                         f"\n\n{SCHEMA}\n\nPassage: {passage}"}] for passage in passages]


def multiturn(engine, args) -> list[list[dict]]:
    questions = [f"Explain {TOPICS[i % len(TOPICS)]} in three sentences." + ("" if i < len(TOPICS) else
                 f" Keep it simple for a {['child', 'student', 'manager'][i // len(TOPICS) - 1]}.")
                 for i in range(args.count)]
    answers = _answers(engine, [[{"role": "user", "content": q}] for q in questions], args.max_new_tokens)
    return [[{"role": "user", "content": q}, {"role": "assistant", "content": a},
             {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}]
            for i, (q, a) in enumerate(zip(questions, answers))]


def code_function(rng: random.Random) -> str:
    """A 40-line function: a signature, the drawn steps, padding comments, a return."""
    thing = rng.choice(THINGS)
    lines = [f"def summarize_{thing}(records, threshold, verbose=False):"]
    for number, step in enumerate(STEPS, 1):
        lines += [f"    # step {number}: {rng.choice(['collect', 'check', 'update', 'report'])} the {thing}"]
        lines += step
    while len(lines) < 39:
        lines.insert(1, f"    # note: {rng.choice(THINGS)} below the threshold are skipped")
    lines.append("    return {\"mean\": mean, \"spread\": spread, \"largest\": largest, \"flagged\": flagged, "
                 "\"counts\": counts}")
    return "\n".join(lines)


def code_edits(count: int) -> list[list[dict]]:
    rng = random.Random(1)
    return [[{"role": "user", "content": f"{EDITS[i % len(EDITS)]}\n\n```python\n{code_function(rng)}\n```"}]
            for i in range(count)]


def chat(count: int) -> list[list[dict]]:
    from bench.spec_defaults import load_prompts

    texts = load_prompts("chat", 1000)
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(count)]
