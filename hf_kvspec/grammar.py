"""Structured output: a logits processor that removes every token a grammar forbids after the tokens generated so
far (a JSON schema, any JSON object, a regular expression or a Lark grammar), with llguidance's matcher.

Boundary: a transformers-style logits processor, ``(input_ids [B, L], scores [B, V]) -> scores``, and nothing
else: ``model.generate(..., logits_processor=[...])``, ``Engine.add_request(logits_processor=[...])`` and the
server's ``response_format`` all take it as it is. Forbidden tokens get ``-inf``; the end-of-sequence token is
allowed exactly when the grammar may end, and is the only token left once it must.

State follows ``input_ids``. The first call's length is the prompt's; each call compares the tokens generated
since with the ones the row's matcher consumed, rolls the matcher back to their common prefix and consumes the
rest. So calls may come in any order over any paths — the speculative verifier scores every draft node after its
own path, siblings one after another — and each gets the mask a plain decode of that path would get: greedy
output under a grammar is identical with and without speculation, and sampled output keeps the constrained
distribution. A draft the grammar forbids has probability 0 under the masked target and is never accepted; a
path through such a draft leaves its scores unmasked (they are never used: nothing below a rejected draft is
accepted). A call whose prompt differs from the remembered one starts over (a new ``generate`` call).

Why llguidance (``pip install 'hf-kvspec[grammar]'``): no dependencies, a wheel for every platform, and its mask
costs about 0.2 ms per token for SmolLM2's 49k vocabulary on this project's 2-core CPU (under 1% of a decode
step; ``docs/structured_output.md`` has the figures). xgrammar, the
other well-kept engine, requires triton on Linux x86-64 (hundreds of MB for a CPU user), so it was not taken.

Shapes: ``B`` rows · ``L`` tokens (prompt + generated) · ``V`` vocabulary (the scores', which may exceed the
tokenizer's).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping

import torch

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF tokenizer -> {V: LLTokenizer}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as err:
        raise ImportError("Structured output needs llguidance: pip install 'hf-kvspec[grammar]' (or "
                          "pip install llguidance).") from err
    return llguidance


def compile_grammar(*, json_schema: Mapping | str | None = None, json_object: bool = False, regex: str | None = None,
                    lark: str | None = None) -> str:
    """One grammar from exactly one of: a JSON schema (a dict or its JSON text), any JSON object, a regular
    expression, a Lark grammar. Raises ``ValueError`` naming what is wrong with it."""
    given = [name for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                      ("regex", regex), ("lark", lark)) if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of json_schema, json_object=True, regex, lark; got {given or 'none'}.")
    matcher = _llguidance().LLMatcher
    if json_schema is not None or json_object:
        schema = json_schema if json_schema is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise ValueError(f"json_schema is not valid JSON: {err}") from None
        if not isinstance(schema, Mapping):
            raise ValueError(f"json_schema must be a JSON object (a dict), got {type(schema).__name__}.")
        # compact separators unless the schema says otherwise ("x-guidance"): free whitespace lets a model pad
        # forever, and a compact form is what a JSON consumer expects
        grammar = matcher.grammar_from_json_schema(dict(schema), defaults={"whitespace_flexible": False})
    elif regex is not None:
        grammar = matcher.grammar_from_regex(regex)
    else:
        grammar = matcher.grammar_from_lark(lark)
    error = matcher.validate_grammar(grammar)  # "" when it compiles
    if error:
        raise ValueError(f"the grammar does not compile: {error.strip()}")
    return grammar


_BITS = torch.arange(32, dtype=torch.int32)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[ceil(V / 32)]`` int32 words, token t at bit ``t % 32`` of word ``t // 32`` -> ``[V]`` bool."""
    return ((bitmask[:, None] >> _BITS) & 1).reshape(-1)[:vocab_size].bool()


def _tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of ``tokenizer`` for ``vocab_size`` scores (built once: it takes about a second)."""
    per_size = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab_size not in per_size:
        per_size[vocab_size] = _llguidance().hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    return per_size[vocab_size]


class GrammarLogitsProcessor:
    """Masks the tokens a grammar forbids (module docstring). One per request or ``generate`` call (it keeps the
    rows' matchers); ``fork()`` gives a fresh one for the same grammar.

    Args:
        tokenizer: the model's fast Hugging Face tokenizer.
        json_schema / json_object / regex / lark: the grammar, exactly one (``compile_grammar``); or
        grammar: one ``compile_grammar`` returned (compile once, build a processor per request).
    """

    def __init__(self, tokenizer, *, json_schema: Mapping | str | None = None, json_object: bool = False,
                 regex: str | None = None, lark: str | None = None, grammar: str | None = None):
        self.tokenizer = tokenizer
        self.grammar = grammar if grammar is not None else compile_grammar(
            json_schema=json_schema, json_object=json_object, regex=regex, lark=lark)
        self._prompt: torch.Tensor | None = None  # [B, L0] the first call's input_ids
        self._matchers: list = []
        self._consumed: list[list[int]] = []  # per row: the generated tokens its matcher consumed

    def fork(self) -> GrammarLogitsProcessor:
        """A fresh processor for the same grammar (one per request)."""
        return GrammarLogitsProcessor(self.tokenizer, grammar=self.grammar)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        llg = _llguidance()
        if self._prompt is None or not self._continues(input_ids):
            self._start(input_ids, scores.shape[-1])
        scores = scores.clone()
        bitmask = llg.torch.allocate_token_bitmask(1, scores.shape[-1])  # [1, ceil(V / 32)] int32
        for row in range(input_ids.shape[0]):
            if self._follow(row, input_ids[row, self._prompt.shape[1]:].tolist()):
                llg.torch.fill_next_token_bitmask(self._matchers[row], bitmask, 0)
                allowed = _unpack(bitmask[0], scores.shape[-1]).to(scores.device)  # [V] bool
                scores[row].masked_fill_(~allowed, float("-inf"))
        return scores

    def allowed_drafts(self, tokens: list[int], drafts: list[int], parents: list[int] | None) -> list[bool] | None:
        """Per draft node (``parents``: each node's parent index, -1 for the root's children; None for a chain),
        whether the grammar allows its path after ``tokens`` (one row's input so far); None when this processor
        has not seen that row's prompt (nothing is cut). The engine drops forbidden drafts before verifying
        them: the masked target would give them probability 0."""
        prompt = self._prompt
        if prompt is None or prompt.shape[0] != 1 or len(tokens) < prompt.shape[1] or \
                tokens[: prompt.shape[1]] != prompt[0].tolist():
            return None
        generated = tokens[prompt.shape[1]:]
        paths: list[list[int]] = []
        allowed = []
        for node, token in enumerate(drafts):
            parent = node - 1 if parents is None else parents[node]
            path = ([] if parent < 0 else paths[parent]) + [token]
            paths.append(path)
            ok = (parent < 0 or allowed[parent]) and self._follow(0, generated + path[:-1]) and \
                self._matchers[0].validate_tokens([token]) == 1
            allowed.append(ok)
        return allowed

    def _continues(self, input_ids: torch.Tensor) -> bool:
        prompt = self._prompt
        return (input_ids.shape[0] == prompt.shape[0] and input_ids.shape[1] >= prompt.shape[1]
                and torch.equal(input_ids[:, : prompt.shape[1]].cpu(), prompt))

    def _start(self, input_ids: torch.Tensor, vocab_size: int) -> None:
        llg = _llguidance()
        tokenizer = _tokenizer(self.tokenizer, vocab_size)
        self._prompt = input_ids.detach().cpu().clone()
        self._matchers = [llg.LLMatcher(tokenizer, self.grammar) for _ in range(input_ids.shape[0])]
        self._consumed = [[] for _ in range(input_ids.shape[0])]

    def _follow(self, row: int, generated: list[int]) -> bool:
        """Bring row ``row``'s matcher to ``generated``; False when the grammar forbids a token of it."""
        matcher, consumed = self._matchers[row], self._consumed[row]
        common = 0
        for have, want in zip(consumed, generated):
            if have != want:
                break
            common += 1
        if common < len(consumed):
            matcher.rollback(len(consumed) - common)
            del consumed[common:]
        rest = generated[common:]
        valid = matcher.validate_tokens(rest) if rest else 0
        if valid:
            matcher.consume_tokens(rest[:valid])
            consumed += rest[:valid]
        return valid == len(rest)
