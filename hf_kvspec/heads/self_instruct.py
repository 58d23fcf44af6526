"""Diverse self-distilled chat data: the target writes the user requests (self-instruct), reads corpus passages, and
answers both greedily and by sampling; some chats get a follow-up turn that the target also writes. A prompts file
(one request per row, e.g. the templated ``chat_prompts_train_large.jsonl``) can be answered beside them, a seeded
slice of it at a time, so that a large file is answered over several runs into disjoint chat files.

Boundary: a target model, its tokenizer, a ``HeldOut`` set and ``RecipeSettings`` in; chat rows
(``{"messages": [...], "source", "answer"}``) and a recipe summary (counts, duplicate rate, settings) out. Generation
is batched, cached on disk and resumable (``BatchCache``); knows nothing about heads or features.

Why: heads trained on a few thousand templated requests see one style of question; EAGLE and Medusa train on tens of
thousands of varied conversations. Self-instruct (Wang et al., arXiv 2212.10560) gets variety from the model itself:
a small seed list of genres x tasks, sampled at temperature ~1, deduplicated on normalised text. Answers come from the
target (self-distillation), greedy and at temperature 0.7, so the heads learn the distribution they will draft for.
Deviation from the paper: no ROUGE-based filtering (exact duplicates after normalisation only) and no classification
tasks; the model is small, so requests are one to three sentences.

Determinism and resume: a stage's prompts are sorted by length (stable) and cut into fixed batches; batch i is
generated under ``torch.manual_seed(hash(seed, stage, i))`` and cached as one line keyed by its inputs and settings.
An interrupted run (killed, or stopped by ``max_items``) regenerates only missing batches, with the same batches and
seeds, so its result equals an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_kvspec.heads.data import HeldOut, normalise
from hf_kvspec.heads.distill import DistillSettings, chat_ids, generate_batch

GENRES = (
    "cooking", "travel planning", "personal finance", "software engineering", "world history", "biology",
    "creative writing", "fitness", "gardening", "job hunting", "school mathematics", "physics", "music", "films",
    "running a small business", "parenting", "pet care", "home repair", "learning a language", "data analysis",
    "astronomy", "chemistry", "philosophy", "sports", "email and office work", "web development", "health",
    "geography", "economics", "art and design",
)
#: task -> (genre, example request): one hand-written shot per task, shown from another genre than the one asked for
TASKS = {
    "explanation": ("astronomy", "Why does the Moon look bigger when it is close to the horizon?"),
    "instructions": ("home repair", "How do I fix a dripping kitchen tap, step by step?"),
    "poem": ("sports", "Can you write a four-line poem about a rainy football match?"),
    "advice": ("personal finance", "Should I pay off my car loan early or put the money into savings?"),
    "comparison": ("cooking", "What is the difference between baking soda and baking powder?"),
    "ideas": ("running a small business", "Give me five ideas for a name for a bicycle repair shop."),
    "story": ("pet care", "Write a very short story about a cat who learns to open the fridge."),
    "rewrite": ("email and office work", "Rewrite this sentence so it sounds more polite: send me the report now."),
    "code": ("data analysis", "Write a Python function that returns the average of the numbers in a CSV column."),
    "plan": ("fitness", "Make me a one-week plan to start running three times a week."),
    "pros and cons": ("travel planning", "What are the pros and cons of travelling by night train?"),
    "fact": ("world history", "When was the first public library opened, and where?"),
    "email": ("job hunting", "Help me write a short email thanking an interviewer for their time."),
    "recipe": ("gardening", "How do I make compost tea for tomato plants?"),
    "definition": ("economics", "What is opportunity cost? Give me an everyday example."),
}
#: completion-style few-shot prompt: small instruct models write better requests by continuing a list than by
#: following an instruction to "write a request" (which they tend to answer instead)
REQUEST_PROMPT = ("Messages that users sent to an AI assistant.\n\nTopic: {genre_a}\nMessage: {example_a}\n\n"
                  "Topic: {genre_b}\nMessage: {example_b}\n\nTopic: {genre}\nMessage:")
FOLLOW_UP_PROMPT = ("Here is a question and the answer it received.\n\nQuestion: {question}\n\nAnswer: {answer}\n\n"
                    "Write the next message the person might send: one short follow-up question or request about "
                    "the answer. Write only that message.")
_LABEL = re.compile(r"^(?:here(?:'s| is)[^:\n]*:|(?:the )?(?:user'?s? )?(?:message|request|question|follow-up)[^:\n]"
                    r"{0,20}:|user:)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class RecipeSettings:
    seed: int = 0
    num_requests: int = 200             # self-instruct candidates generated (before dedup / filters)
    num_reading: int = 100              # reading tasks kept
    corpora: tuple[str, ...] = ("python-docs", "python-stdlib")
    follow_up_fraction: float = 0.5     # share of kept requests that get a second turn
    sampled_answers: bool = True        # one answer at answer_temperature besides the greedy one
    request_temperature: float = 1.0
    answer_temperature: float = 0.7
    request_max_new_tokens: int = 40
    answer_max_new_tokens: int = 128
    batch_size: int = 16
    tasks: tuple[str, ...] | None = None  # seed tasks to draw from (names of TASKS); None: all of them
    prompts: str | None = None          # a prompts file (JSONL "prompt" column, or one per line) answered as well
    prompts_start: int = 0              # the slice [start, start + num_prompts) of its rows shuffled by seed
    num_prompts: int | None = None      # None: every row from prompts_start on


@dataclass
class DistillData:
    rows: list[dict]
    recipe: dict
    complete: bool = True               # False: stopped by max_items; run again to continue


class BatchCache:
    """Batched generation in fixed, seeded batches, each cached as one JSONL line (see the module docstring).

    ``max_items``: stop before a new batch once this many items were generated in this run (so at most
    ``max_items + batch_size - 1``); the stage then returns None for what is missing.
    """

    def __init__(self, model, tokenizer, path: str | Path, fingerprint: str, max_items: int | None = None,
                 progress: bool = True):
        self.model, self.fingerprint, self.path = model, fingerprint, Path(path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_items, self.progress, self.generated, self.new_tokens = max_items, progress, 0, 0
        rows = (json.loads(line) for line in self.path.read_text().splitlines() if line.strip()) \
            if self.path.is_file() else ()
        self.done = {row["key"]: row["outputs"] for row in rows}

    @property
    def stopped(self) -> bool:
        return self.max_items is not None and self.generated >= self.max_items

    def run(self, stage: str, prompts: list[list[int]], settings: DistillSettings) -> list[list[int] | None]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths: little padding
        batches = [order[i:i + settings.batch_size] for i in range(0, len(order), settings.batch_size)]
        outputs: list[list[int] | None] = [None] * len(prompts)
        keys = [self._key(stage, n, [prompts[i] for i in batch], settings) for n, batch in enumerate(batches)]
        todo = sum(key not in self.done for key in keys)
        bar = tqdm(total=todo, desc=stage, unit="batch", disable=not self.progress or not todo)
        for n, (batch, key) in enumerate(zip(batches, keys)):
            if key not in self.done:
                if self.stopped:
                    break
                self._generate(key, _batch_seed(settings.seed, stage, n), [prompts[i] for i in batch], settings)
                bar.update(1)
            for i, out in zip(batch, self.done[key]):
                outputs[i] = out
        bar.close()
        return outputs

    def _generate(self, key: str, seed: int, batch: list[list[int]], settings: DistillSettings) -> None:
        torch.manual_seed(seed)
        outs = generate_batch(self.model, batch, self.pad_id, settings)
        self.done[key] = outs
        self.generated += len(batch)
        self.new_tokens += sum(map(len, outs))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as sink:  # one line per batch: a kill loses at most the batch in flight
            sink.write(json.dumps({"key": key, "outputs": outs}) + "\n")

    def _key(self, stage: str, n: int, batch: list[list[int]], settings: DistillSettings) -> str:
        recipe = {k: v for k, v in asdict(settings).items() if k != "batch_size"}
        return hashlib.sha256(json.dumps([self.fingerprint, stage, n, batch, recipe]).encode()).hexdigest()


def _batch_seed(seed: int, stage: str, n: int) -> int:
    return int(hashlib.sha256(f"{seed}/{stage}/{n}".encode()).hexdigest()[:8], 16)


def clean_request(text: str) -> str | None:
    """The message itself (labels like "User:" and wrapping quotes removed, first paragraph), or None when it is too
    short or too long to be a request, or is labelled as an answer."""
    if re.match(r"(?:your (?:new )?)?answer\s*:", text.strip(), re.IGNORECASE):
        return None  # the model went on writing an answer, not the user's next message
    text = _LABEL.sub("", text.strip()).strip()
    text = text.split("\n\n")[0].strip().strip("\"'“”").strip()
    if len(text) < 15 or len(text) > 500 or len(text.split()) < 4:
        return None
    return text


@dataclass
class _Filter:
    """Deduplication (normalised text, across all sources) and held-out filtering, with counts for the recipe."""

    held_out: HeldOut
    seen: set = field(default_factory=set)

    def keep(self, texts: list[str | None]) -> tuple[list[int], dict]:
        kept, counts = [], {"candidates": len(texts), "rejected_format": 0, "duplicates": 0, "held_out_leaks": 0}
        for i, text in enumerate(texts):
            if text is None:
                counts["rejected_format"] += 1
            elif normalise(text) in self.seen:
                counts["duplicates"] += 1
            elif self.held_out.leak(text):
                counts["held_out_leaks"] += 1
            else:
                self.seen.add(normalise(text))
                kept.append(i)
        well_formed = len(texts) - counts["rejected_format"]
        counts["duplicate_rate"] = round(counts["duplicates"] / well_formed, 4) if well_formed else 0.0
        counts["kept"] = len(kept)
        return kept, counts


def seed_specs(settings: RecipeSettings) -> list[tuple[str, str]]:
    """(genre, task) per self-instruct candidate, drawn with ``random.Random(seed)`` from ``settings.tasks`` (all
    tasks when None: e.g. ``("explanation", "comparison", "definition")`` steers the requests to long answers)."""
    tasks = sorted(TASKS) if settings.tasks is None else sorted(check_tasks(settings.tasks))
    rng = random.Random(settings.seed)
    return [(rng.choice(GENRES), rng.choice(tasks)) for _ in range(settings.num_requests)]


def check_tasks(tasks) -> tuple[str, ...]:
    """``tasks`` if they are distinct names of ``TASKS``; else a ValueError naming the known ones."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks or len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks {list(tasks)}: give one or more distinct seed tasks out of {', '.join(sorted(TASKS))}"
                         f"{f' ({unknown} unknown)' if unknown else ''}.")
    return tuple(tasks)


def request_prompts(specs: list[tuple[str, str]], seed: int) -> list[str]:
    """The few-shot text per (genre, task): a random other task's shot, then the asked task's shot, then the genre."""
    rng = random.Random(seed + 2)
    prompts = []
    for genre, task in specs:
        other = rng.choice(sorted(set(TASKS) - {task}))
        (genre_a, example_a), (genre_b, example_b) = TASKS[other], TASKS[task]
        prompts.append(REQUEST_PROMPT.format(genre_a=genre_a, example_a=example_a, genre_b=genre_b,
                                             example_b=example_b, genre=genre))
    return prompts


def build_distill_data(model, tokenizer, cache_file: str | Path, fingerprint: str, held_out: HeldOut,
                       settings: RecipeSettings = RecipeSettings(), max_items: int | None = None,
                       progress: bool = True) -> DistillData:
    """Self-instruct requests, reading tasks, follow-ups and their answers (see the module docstring)."""
    cache = BatchCache(model, tokenizer, cache_file, fingerprint, max_items, progress)
    gen = _Generator(cache, tokenizer, settings)
    sieve, recipe = _Filter(held_out), {"settings": asdict(settings), "seed_genres": len(GENRES),
                                        "seed_tasks": len(TASKS)}
    specs = seed_specs(settings)
    drafts = gen.texts("requests", request_prompts(specs, settings.seed), settings.request_temperature,
                       settings.request_max_new_tokens)
    if drafts is None:
        return _incomplete(recipe)
    drafts = [draft.split("\n")[0] for draft in drafts]  # one list item: the text up to the end of its line
    kept, recipe["self_instruct"] = sieve.keep([clean_request(t) for t in drafts])
    requests = [clean_request(drafts[i]) for i in kept]
    tasks = _reading(settings, sieve, recipe)
    listed = _listed(settings, sieve, recipe)
    prompts = ([(r, "self-instruct") for r in requests] + [(t.prompt, f"reading:{t.corpus}") for t in tasks]
               + [(p, f"prompts:{Path(settings.prompts).name}") for p in listed])
    rows, greedy = _answer(gen, settings, prompts)
    if rows is None:
        return _incomplete(recipe)
    follow_rows = _follow_ups(gen, settings, sieve, recipe, requests, greedy[:len(requests)])
    if follow_rows is None:
        return _incomplete(recipe)
    rows += follow_rows
    held_out.check([m["content"] for row in rows for m in row["messages"] if m["role"] == "user"])
    recipe["rows"] = _row_counts(rows)
    recipe["generated_tokens_this_run"] = cache.new_tokens
    return DistillData(rows, recipe)


class _Generator:
    """Chats in, decoded texts out, through the cache; None when the cache stopped (max_items)."""

    def __init__(self, cache: BatchCache, tokenizer, settings: RecipeSettings):
        self.cache, self.tokenizer, self.settings = cache, tokenizer, settings

    def texts(self, stage: str, chats: list[list[dict]] | list[str], temperature: float | None,
              max_new_tokens: int):
        """Chats go through the chat template; plain strings are continued as they are (completion style)."""
        distill = DistillSettings(max_new_tokens=max_new_tokens, batch_size=self.settings.batch_size,
                                  do_sample=temperature is not None, temperature=temperature or 1.0,
                                  seed=self.settings.seed)
        ids = [self.tokenizer(chat)["input_ids"] if isinstance(chat, str) else chat_ids(self.tokenizer, chat)
               for chat in chats]
        outs = self.cache.run(stage, ids, distill)
        if any(out is None for out in outs):
            return None
        return [self.tokenizer.decode(out, skip_special_tokens=True).strip() for out in outs]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _reading(settings: RecipeSettings, sieve: _Filter, recipe: dict) -> list:
    from hf_kvspec.heads.reading_tasks import reading_tasks

    tasks = reading_tasks(settings.num_reading, settings.seed, settings.corpora) if settings.num_reading else []
    kept, recipe["reading"] = sieve.keep([t.prompt for t in tasks])
    chosen = [tasks[i] for i in kept][:settings.num_reading]
    recipe["reading"]["kept"] = len(chosen)
    recipe["reading"]["per_corpus"] = {c: sum(t.corpus == c for t in chosen) for c in settings.corpora if tasks}
    return chosen


def prompt_slice(settings: RecipeSettings) -> list[str]:
    """The rows of ``settings.prompts`` that this recipe answers: the file's rows in an order shuffled by
    ``random.Random(seed)``, then ``[prompts_start, prompts_start + num_prompts)``. Slices of one seed are disjoint,
    so a large file can be answered over several runs; [] without a prompts file."""
    if settings.prompts is None:
        return []
    from hf_kvspec.heads.data import read_prompts

    rows = read_prompts(settings.prompts)
    random.Random(settings.seed).shuffle(rows)
    stop = None if settings.num_prompts is None else settings.prompts_start + settings.num_prompts
    return rows[settings.prompts_start:stop]


def _listed(settings: RecipeSettings, sieve: _Filter, recipe: dict) -> list[str]:
    """The prompts-file slice after deduplication and the held-out filter (counted in ``recipe["prompts"]``)."""
    rows = prompt_slice(settings)
    kept, counts = sieve.keep(rows)
    if settings.prompts is not None:
        recipe["prompts"] = {"file": Path(settings.prompts).name, **counts}
    return [rows[i] for i in kept]


def _answer(gen: _Generator, settings: RecipeSettings, prompts: list[tuple[str, str]]):
    """Greedy (and sampled) answers to single-turn prompts: (rows, greedy answer texts) or (None, None)."""
    chats = [[_user(p)] for p, _ in prompts]
    greedy = gen.texts("answers-greedy", chats, None, settings.answer_max_new_tokens)
    sampled = (gen.texts("answers-sampled", chats, settings.answer_temperature, settings.answer_max_new_tokens)
               if settings.sampled_answers and greedy is not None else [])
    if greedy is None or sampled is None:
        return None, None
    rows = [_row([_user(p), _assistant(a)], source, "greedy") for (p, source), a in zip(prompts, greedy)]
    rows += [_row([_user(p), _assistant(a)], source, f"sampled t={settings.answer_temperature}")
             for (p, source), a in zip(prompts, sampled)]
    return rows, greedy


def _follow_ups(gen: _Generator, settings: RecipeSettings, sieve: _Filter, recipe: dict, requests: list[str],
                answers: list[str]) -> list[dict] | None:
    """Second turns: the target writes a follow-up to its own greedy answer, then answers it greedily."""
    count = round(settings.follow_up_fraction * len(requests))
    picked = sorted(random.Random(settings.seed + 1).sample(range(len(requests)), count))
    drafts = gen.texts("follow-up-requests", [[_user(FOLLOW_UP_PROMPT.format(question=requests[i],
                                                                             answer=answers[i]))] for i in picked],
                       settings.request_temperature, settings.request_max_new_tokens)
    if drafts is None:
        return None
    kept, recipe["follow_ups"] = sieve.keep([clean_request(t) for t in drafts])
    chats = [[_user(requests[picked[k]]), _assistant(answers[picked[k]]), _user(clean_request(drafts[k]))]
             for k in kept]
    replies = gen.texts("follow-up-answers", chats, None, settings.answer_max_new_tokens)
    if replies is None:
        return None
    return [_row([*chat, _assistant(reply)], "self-instruct follow-up", "greedy")
            for chat, reply in zip(chats, replies)]


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _row(messages: list[dict], source: str, answer: str) -> dict:
    return {"messages": messages, "source": source, "answer": answer}


def _row_counts(rows: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for row in rows:
        name = f"{row['source']} / {row['answer']}"
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _incomplete(recipe: dict) -> DistillData:
    return DistillData([], recipe, complete=False)


def write_data(data: DistillData, path: str | Path) -> Path:
    """Rows as JSONL at ``path`` and the recipe beside it (``<path>.recipe.json``, read by train_drafter)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in data.rows))
    recipe_path(path).write_text(json.dumps(data.recipe, indent=2))
    return path


def recipe_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".recipe.json")
