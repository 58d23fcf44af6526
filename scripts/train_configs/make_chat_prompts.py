"""Write the large chat-prompt set used to self-distill training data for the bundled model's draft heads.

    python scripts/train_configs/make_chat_prompts.py            # -> scripts/train_configs/chat_prompts_train_large.jsonl
    python scripts/train_configs/make_chat_prompts.py --docs     # -> runs/drafter_data/chat_prompts_python_docs.jsonl

The prompts are short one-turn requests (explain, list, compare, write code, rewrite) over a hand-written topic list,
crossed with templates. Nothing here is model output: the *answers* come later from the target itself
(``--self_distill``), which is what the heads learn.

``--docs`` instead wraps prose paragraphs of the offline Python documentation corpus (``corpus:python-docs``, train
split) in reading tasks (summarize / explain / ask about this passage). That file quotes the PSF-licensed docs, so it
is written under ``runs/`` (git-ignored) rather than committed; the command rebuilds it identically.

Held out on purpose, so that the held-out acceptance in the model cards measures generalisation:
- every topic and every template of ``chat_prompts_heldout.jsonl`` (checked below: a collision raises);
- the held-out file's Python-function tasks.
Deterministic: the same file on every run (fixed seed, sorted inputs).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from hf_kvspec.heads.data import HeldOut

HERE = Path(__file__).resolve().parent

TOPICS = """
photosynthesis; the water cycle; plate tectonics; volcanoes; black holes; the solar system; the Moon; Mars; comets;
the Big Bang; gravity; magnetism; electricity; static electricity; sound waves; light; rainbows; the speed of light;
atoms; molecules; chemical bonds; acids and bases; the periodic table; nuclear fission; nuclear fusion; radioactivity;
DNA; genes; cells; mitochondria; bacteria; viruses; vaccines; antibiotics; the immune system; the brain; sleep;
memory; nutrition; vitamins; exercise; the lungs; the skeleton; muscles; blood types; evolution; natural selection;
dinosaurs; fossils; bees; ants; whales; sharks; octopuses; birds' migration; rainforests; deserts; glaciers; oceans;
tides; hurricanes; tornadoes; lightning; climate change; weather forecasting; clouds; soil; recycling; composting;
renewable energy; solar panels; wind turbines; batteries; electric cars; hydrogen fuel; nuclear power plants;
the internet; email; web browsers; search engines; cookies in web browsers; passwords; encryption; public-key
cryptography; hashing; blockchains; computer viruses; firewalls; cloud computing; data centers; GPUs; CPUs;
transistors; binary numbers; floating-point numbers; compilers; interpreters; version control; git branches;
open-source software; Linux; the command line; shell scripts; regular expressions; databases; SQL joins;
spreadsheets; JSON; XML; REST APIs; HTTP status codes; DNS; TCP and UDP; Wi-Fi; Bluetooth; GPS; smartphones;
touchscreens; 3D printing; robots; drones; self-driving cars; machine learning; neural networks; gradient descent;
overfitting; decision trees; linear regression; large language models; computer vision; speech recognition;
recommendation systems; sorting algorithms; binary search; hash tables; linked lists; stacks and queues; trees in
computer science; graphs in computer science; recursion; dynamic programming; Big O notation; object-oriented
programming; unit testing; debugging; code review; Python decorators; Python generators; list comprehensions;
virtual environments; type hints; exceptions in Python; asynchronous programming; threads; memory leaks; caching;
prime numbers; fractions; percentages; probability; statistics; the mean and the median; matrices; vectors;
derivatives; integrals; the Pythagorean theorem; pi; infinity; logarithms; compound interest; budgeting; taxes;
inflation; supply and demand; banks; credit cards; insurance; startups; marketing; negotiation; public speaking;
time management; note taking; learning a new language; reading habits; writing an essay; job interviews; teamwork;
leadership; giving feedback; remote work; the Roman Empire; ancient Egypt; the pyramids; ancient Greece; the Silk
Road; the Renaissance; the printing press; the French Revolution; the American Revolution; the Cold War; the Space
Race; the Moon landing; World War I; the Great Depression; the Olympic Games; democracy; elections; the United
Nations; human rights; maps; time zones; calendars; clocks; money; trade; agriculture; irrigation; bread baking;
coffee brewing; tea; chocolate; cheese making; fermentation; cooking pasta; knife skills; food safety; gardening;
houseplants; composting at home; bicycles; running; swimming; chess; soccer; basketball; music theory; the piano;
the guitar; orchestras; jazz; photography; painting; sculpture; poetry; novels; theater; film making; animation;
video games; board games; museums; libraries; architecture; bridges; skyscrapers; roads; trains; airplanes; ships;
rockets; satellites; telescopes; microscopes; thermometers; refrigerators; microwave ovens; electric motors; engines;
friction; levers; pulleys; buoyancy; pressure; temperature; energy; heat; entropy; quantum mechanics; relativity
""".replace("\n", " ")

TEMPLATES = [
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give me three facts about {t}.",
    "What is a common misconception about {t}?",
    "What are the main ideas behind {t}?",
    "How would you teach {t} to a beginner?",
    "Summarize {t} in a few sentences.",
    "Why does {t} matter?",
    "Write a short quiz with answers about {t}.",
    "List the key terms someone should learn about {t}.",
    "Give an everyday analogy for {t}.",
    "What questions do people often ask about {t}?",
    "Write a tweet-length summary of {t}.",
    "Explain {t} to a ten-year-old.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "Give a step-by-step overview of {t}.",
    "What would a textbook chapter on {t} cover?",
    "Write an opening sentence for an article about {t}.",
    "How has our understanding of {t} changed over time?",
    "What is one surprising thing about {t}?",
    "Describe {t} in exactly three sentences.",
    "Write a short dialogue between a teacher and a student about {t}.",
    "What careers involve {t}?",
    "Give me a mnemonic for remembering something about {t}.",
    "Write a short story that involves {t}.",
    "Compare {t} with something similar.",
    "What are common mistakes beginners make with {t}?",
]

CODE_TASKS = """
reverses a string; counts the vowels in a string; checks whether a number is prime; returns the factorial of n;
returns the n-th Fibonacci number; removes duplicates from a list while keeping order; flattens a nested list;
merges two sorted lists; finds the most common element of a list; checks whether a string is a palindrome;
converts Celsius to Fahrenheit; computes the average of a list of numbers; splits a list into chunks of size n;
counts the words in a sentence; capitalizes every word in a sentence; returns the largest number in a list;
checks whether a year is a leap year; computes the greatest common divisor of two numbers; converts an integer to
binary; sorts a list of tuples by their second element; returns all even numbers from a list; builds a dictionary
from two lists; inverts a dictionary; finds the intersection of two lists; rotates a list by k positions; checks
whether a list is sorted; returns the length of the longest word in a sentence; computes the power set of a list;
transposes a matrix given as a list of lists; validates an email address with a regular expression; reads a CSV
file and returns its rows; counts the lines in a text file; computes the median of a list; implements binary
search; implements bubble sort; returns the digits of an integer as a list; checks whether two lists have the same
elements; generates a random password; formats a number with thousands separators; returns the n smallest items of
a list
""".replace("\n", " ")

CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Show me a short Python example that {t}.",
    "Write a JavaScript function that {t}.",
]


def split(items: str) -> list[str]:
    return sorted({item.strip() for item in items.split(";") if item.strip()})


def heldout_topics_and_templates(path: Path) -> tuple[set[str], set[str]]:
    """Topics and template skeletons of the held-out prompts (skeleton = prompt with the topic replaced by {t})."""
    patterns = [r"Explain (.+) to a high-school student\.", r"What should everyone know about (.+)\?",
                r"Describe the history of (.+) briefly\.", r"Write a Python function that (.+)\."]
    topics, skeletons = set(), set()
    for line in path.read_text().splitlines():
        prompt = json.loads(line)["prompt"]
        for pattern in patterns:
            if match := re.fullmatch(pattern, prompt):
                topics.add(match.group(1).lower())
                skeletons.add(prompt.replace(match.group(1), "{t}"))
    return topics, skeletons


def build(seed: int = 0) -> list[str]:
    topics, tasks = split(TOPICS), split(CODE_TASKS)
    held_topics, held_templates = heldout_topics_and_templates(HERE / "chat_prompts_heldout.jsonl")
    clash = ({t.lower() for t in topics + tasks} & held_topics) | (set(TEMPLATES) & held_templates)
    if clash:
        raise ValueError(f"Training prompts would overlap the held-out set: {sorted(clash)}")
    prompts = [tpl.format(t=t) for t in topics for tpl in TEMPLATES]
    prompts += [tpl.format(t=t) for t in tasks for tpl in CODE_TEMPLATES]
    HeldOut.from_file(str(HERE / "chat_prompts_heldout.jsonl")).check(prompts)  # the library's check, as training
    random.Random(seed).shuffle(prompts)
    return prompts


DOC_TEMPLATES = [
    "Summarize the following paragraph in one sentence:\n\n{t}",
    "Explain this passage from the Python documentation in plain words:\n\n{t}",
    "Write two questions a student might ask about this text, and answer them:\n\n{t}",
    "What is the main point of this paragraph?\n\n{t}",
]
_ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")   # :func:`open` / :ref:`text <target>` -> text


def prose_paragraphs(text: str, min_chars: int = 200, max_chars: int = 500) -> list[str]:
    """Plain prose paragraphs of a reST source: no directives, tables, lists, code or headings."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip().splitlines()
        if not lines or any(line.startswith((" ", "\t", "..", "*", "-", "+", "=", "|", ">>>", "#")) for line in lines):
            continue
        paragraph = " ".join(line.strip() for line in lines)
        paragraph = _ROLE.sub(r"\1", paragraph).replace("``", "")
        if min_chars <= len(paragraph) <= max_chars and paragraph[0].isupper() and paragraph.endswith("."):
            found.append(paragraph)
    return found


def build_docs(limit: int = 4000, seed: int = 0) -> list[str]:
    from hf_kvspec.corpus import load_text_corpus

    paragraphs = sorted({p for text in load_text_corpus("python-docs", "train")["text"] for p in prose_paragraphs(text)})
    random.Random(seed).shuffle(paragraphs)
    return [DOC_TEMPLATES[i % len(DOC_TEMPLATES)].format(t=p) for i, p in enumerate(paragraphs[:limit])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", action="store_true", help="reading tasks over the Python docs corpus instead")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    default = (HERE.parent.parent / "runs" / "drafter_data" / "chat_prompts_python_docs.jsonl" if args.docs else
               HERE / "chat_prompts_train_large.jsonl")
    output = Path(args.output or default)
    prompts = build_docs() if args.docs else build()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {output}")


if __name__ == "__main__":
    main()
