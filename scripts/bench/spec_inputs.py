"""The prompts and input helpers shared by the speculative benchmarks (``spec.py``, ``spec_defaults.py``).

Boundary: data and tokenisation only; no timing, no models.
"""

from __future__ import annotations

import torch

_TEXT_A = (
    "The city council met on Tuesday to discuss the new bicycle lanes planned for the river district. Supporters "
    "said the lanes would make commuting safer and reduce traffic near the schools. Shop owners worried that "
    "removing parking spaces would hurt their business during the winter months. After two hours of debate, the "
    "council voted to build the lanes on a trial basis for one year and to review the effect on local shops."
)
_TEXT_B = (
    "Researchers at the coastal institute tracked forty sea turtles with satellite tags for three years. The "
    "turtles travelled up to two thousand kilometres between feeding grounds and nesting beaches. Warmer water "
    "pushed some feeding grounds north, and the turtles followed them. The team says protected areas should move "
    "with the animals instead of staying fixed on the map."
)
_TEXT_C = (
    "The library will close its main reading room in March for repairs to the roof, which has leaked during heavy "
    "rain for several years. Books from the reading room will move to the second floor, and study desks will be "
    "set up in the old exhibition hall. The repairs should take about four months, and the library expects to "
    "reopen the room in July with new lighting and more power outlets for laptops."
)
_TEXT_D = (
    "A small bakery in the old town started selling bread made from a grain that farmers in the region had "
    "stopped growing decades ago. The baker worked with two farms to plant the grain again and to mill it "
    "locally. The bread sells out every morning, and the farms plan to double the area they plant next year."
)

PROMPTS = {
    "chat": "What are three simple ways to sleep better at night? Answer in short sentences.",
    "code": "Write a Python function `is_palindrome(s)` that ignores case and spaces, with a docstring.",
    "summarize": f"Summarize the following text in two sentences, reusing its wording.\n\n{_TEXT_A}",
}
BATCH_SUMMARIES = [f"Summarize the following text in two sentences, reusing its wording.\n\n{text}"
                   for text in (_TEXT_A, _TEXT_B, _TEXT_C, _TEXT_D)]


def chat_inputs(tokenizer, prompts: list[str]) -> dict:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos_id: int) -> int:
    """Real new tokens: up to and including each row's first EOS."""
    total = 0
    for row in sequences[:, prompt_len:].tolist():
        total += row.index(eos_id) + 1 if eos_id in row else len(row)
    return total
