"""Frequency-ranked draft vocabulary (FR-Spec, Zhao et al. 2502.14856): draft heads score only the most frequent
target tokens.

Boundary: a token ranking (ids, most frequent first) computed from text with the target's tokenizer, saved beside a
head, loaded back, and the projection of draft hidden states onto its first ``size`` ids. No drafting, no
verification: the assistants (``drafters/medusa.py``, ``drafters/eagle.py``) call ``DraftVocabulary.logits`` in place
of the full LM head and map the top-k indices back with ``to_target``.

Why: a draft step's LM-head projection costs ``V * H`` multiply-adds per scored row, the largest part of a small
head's step (SmolLM2-135M: V = 49,152, H = 576). Restricting it to the ``V'`` most frequent tokens cuts that by
``V / V'``. Exact either way: the target verifies every draft, so a token outside the draft vocabulary is only
never *proposed* (it is still emitted when the target picks it); the cost is in acceptance (tau), not output.

Deviation from the paper: the ranking also puts the tokenizer's special tokens first (an instruct model's answers
end with its end-of-turn token, which plain text rarely contains).

Compute a ranking (``python -m hf_kvspec.speculative.draft_vocab --help``)::

    python -m hf_kvspec.speculative.draft_vocab --corpus python-docs \\
        --prompts scripts/train_configs/chat_prompts_train_large.jsonl \\
        --out hf_kvspec/bundled_heads/smollm2-135m-instruct-eagle-v2/token_ranking.safetensors

Shapes: ``V`` target vocabulary, ``V'`` draft vocabulary, ``H`` hidden size, ``R`` ranked ids stored.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

RANKING_FILE = "token_ranking.safetensors"  # tensor "token_ids": int32 [R], most frequent first
DEFAULT_STORED = 32768  # ids kept in a shipped ranking (128 KiB as int32)
#: ``draft_vocab_size="shipped"`` (the assistants' default): the first ``SHIPPED_SIZE`` ids of the ranking shipped
#: in the head's directory, when there is one. FR-Spec (2502.14856) reports a few thousand tokens keep nearly all
#: acceptance; docs/heads.md measures 8,192 vs the full vocabulary on the bundled head (tau 1.823 vs 1.837), and
#: the spec benchmark 4,096 on this CPU. Exact at any size (the target verifies).
SHIPPED_SIZE = 4096


def rank_tokens(texts: Iterable[str], tokenizer, vocab_size: int, always: Sequence[int] = (),
                limit: int | None = DEFAULT_STORED) -> torch.Tensor:
    """Token ids of ``vocab_size`` ranked by their count in ``texts`` (tokenized without special tokens), most
    frequent first, ties by id; ``always`` ids first (e.g. ``tokenizer.all_special_ids``). int32 ``[min(limit, V)]``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for text in texts:
        ids = torch.as_tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return ranking_from_counts(counts, always, limit)


def ranking_from_counts(counts: torch.Tensor, always: Sequence[int] = (), limit: int | None = None) -> torch.Tensor:
    """``counts`` [V] -> ids ranked by count (descending, ties by id), ``always`` first; int32 ``[min(limit, V)]``."""
    counts = counts.clone().long()
    first = [i for i in dict.fromkeys(int(t) for t in always) if 0 <= i < counts.shape[0]]
    counts[first] = -1  # out of the count ranking; prepended below
    order = torch.sort(-counts, stable=True).indices  # ties keep ascending ids
    order = torch.cat([torch.tensor(first, dtype=torch.long), order[: counts.shape[0] - len(first)]])
    return order[:limit].to(torch.int32)


def save_ranking(path: str | Path, token_ids: torch.Tensor, **metadata: str) -> None:
    """Write ``token_ids`` [R] (most frequent first) as ``RANKING_FILE``-style safetensors with string metadata."""
    from safetensors.torch import save_file

    save_file({"token_ids": token_ids.to(torch.int32).contiguous()}, str(path), metadata=metadata or None)


def load_ranking(path: str | Path) -> torch.Tensor:
    """The ranked ids [R] (int64) saved by ``save_ranking``."""
    from safetensors.torch import load_file

    return load_file(str(path))["token_ids"].long()


class DraftVocabulary:
    """The draft vocabulary ``token_ids`` [V'] and the LM-head rows it keeps.

    ``logits(hidden, weight)`` scores ``hidden`` [..., H] against rows ``token_ids`` of the full head ``weight``
    [V, H] -> [..., V'] (the reference is the full projection's columns ``token_ids``); ``to_target`` maps column
    indices back to target ids. The kept rows are copied once per weight tensor (a per-step gather would cost
    what the restriction saves).
    """

    def __init__(self, token_ids: torch.Tensor):
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError("a draft vocabulary needs a non-empty 1-D tensor of token ids.")
        if torch.unique(token_ids).numel() != token_ids.numel():
            raise ValueError("draft vocabulary ids must be distinct.")
        if int(token_ids.min()) < 0:
            raise ValueError(f"draft vocabulary ids must be token ids >= 0, got {int(token_ids.min())}; pass the "
                             "ranking's target token ids (most frequent first).")
        self.token_ids = token_ids.long()
        self._rows: dict[tuple, torch.Tensor] = {}

    @classmethod
    def for_head(cls, head, size: int, ranking: torch.Tensor | str | Path | None = None) -> DraftVocabulary:
        """The ``size`` first ids of ``ranking`` (a tensor, a file, or ``None``: the head directory's
        ``RANKING_FILE``, shipped with the bundled heads). ``head`` may be None when ``ranking`` is given (no
        vocabulary to check the ids against)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"draft_vocab_size must be a positive int, got {size!r}.")
        if ranking is None:
            ranking = _shipped_ranking(head)
            if ranking is None:
                where = _ranking_path(head) or f"<head directory>/{RANKING_FILE}"
                raise FileNotFoundError(
                    f"draft_vocab_size needs a token ranking; none at {where}. Compute one with "
                    f"`python -m hf_kvspec.speculative.draft_vocab --out {where}` or pass draft_vocab=<ids tensor>.")
        ids = _ranked_ids(ranking)
        if size > ids.numel():
            raise ValueError(f"draft_vocab_size={size} exceeds the {ids.numel()} ranked ids available.")
        vocab = None if head is None else head.config.base_vocab_size
        if int(ids[:size].min()) < 0:
            raise ValueError(f"the token ranking holds negative ids ({int(ids[:size].min())}); pass target token ids.")
        if vocab is not None and int(ids[:size].max()) >= vocab:
            raise ValueError(f"the token ranking holds ids >= the head's vocabulary ({vocab}): another tokenizer?")
        return cls(ids[:size])

    @property
    def size(self) -> int:
        return self.token_ids.numel()

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [V, H] -> [V', H], cached per weight tensor (and its in-place version)."""
        key = (weight.data_ptr(), weight.device, weight.dtype, weight._version)
        if key not in self._rows:
            self._rows = {key: weight.detach()[self.token_ids.to(weight.device)].contiguous()}
        return self._rows[key]

    @classmethod
    def resolve(cls, head, size: int | str | None, ranking=None) -> DraftVocabulary | None:
        """An assistant's ``draft_vocab_size`` option -> its vocabulary: ``None`` the full vocabulary; an int that
        many ranked ids (``for_head``); ``"shipped"`` (the default) ``SHIPPED_SIZE`` ids of the ranking shipped
        beside ``head`` (or of ``ranking``) when there is one and the head has no trained draft vocabulary of its
        own, else the full vocabulary."""
        if size == "shipped":
            ranking = ranking if ranking is not None else _shipped_ranking(head)
            if ranking is None or getattr(head, "has_draft_vocab", False):
                return None
            ids = _ranked_ids(ranking)
            return cls.for_head(head, min(SHIPPED_SIZE, ids.numel()), ids)
        return None if size is None else cls.for_head(head, size, ranking)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # hidden [..., H], weight [V, H] -> [..., V']
        return torch.einsum("...h,vh->...v", hidden, self.rows(weight).to(hidden.dtype))

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Column indices (any shape) -> target token ids."""
        return self.token_ids.to(index.device)[index]

    def full_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``hidden`` [..., H] -> [..., V] logits: the draft vocabulary's scores at their target ids, ``-inf``
        elsewhere (for chain drafters that process and pick over the target's vocabulary)."""
        scores = self.logits(hidden, weight)  # [..., V']
        out = scores.new_full((*scores.shape[:-1], weight.shape[0]), float("-inf"))
        out[..., self.token_ids.to(scores.device)] = scores
        return out


def _ranked_ids(ranking) -> torch.Tensor:
    """``draft_vocab=``: ids (a tensor, or a list/tuple of ints) or a ranking file -> int64 ids [R]."""
    if isinstance(ranking, torch.Tensor):
        ids = ranking
    elif isinstance(ranking, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ranking):
            raise ValueError(f"draft_vocab as a list holds token ids (ints), got {ranking!r}.")
        ids = torch.tensor(ranking, dtype=torch.long)
    elif isinstance(ranking, (str, Path)):
        ids = load_ranking(ranking)
    else:
        raise TypeError(f"draft_vocab must be token ids (a tensor or list) or a ranking file path, got "
                        f"{type(ranking).__name__}.")
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"draft_vocab must be a 1-D integer tensor of token ids, got {ids.dtype} "
                         f"{tuple(ids.shape)}.")
    return ids.long()


def _ranking_path(head) -> Path | None:
    """Where a head's shipped ranking would be: ``RANKING_FILE`` in its directory (None without a directory)."""
    directory = str(getattr(head, "name_or_path", "") or "")
    return Path(directory) / RANKING_FILE if directory else None


def _shipped_ranking(head) -> Path | None:
    path = _ranking_path(head)
    return path if path is not None and path.is_file() else None


# ---------------------------------------------------------------------------------------------- script entry
def _prompt_texts(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [" ".join(str(v) for k, v in row.items() if k in ("prompt", "response", "text")) for row in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Rank a model's tokens by frequency in offline text (FR-Spec).")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="bundled model whose tokenizer to use")
    parser.add_argument("--corpus", default="python-docs", help="hf_kvspec.corpus name ('' for none)")
    parser.add_argument("--prompts", action="append", default=[], help="jsonl with prompt/response/text fields")
    parser.add_argument("--limit", type=int, default=DEFAULT_STORED, help="ids to keep")
    parser.add_argument("--out", required=True, help=f"output file (e.g. <head dir>/{RANKING_FILE})")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from hf_kvspec.models import bundled_model_path

    model_dir = bundled_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts: list[str] = []
    if args.corpus:
        from hf_kvspec.corpus import load_text_corpus

        texts += load_text_corpus(args.corpus, split="train")["text"]
    for path in args.prompts:
        texts += _prompt_texts(Path(path))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    ranking = rank_tokens(texts, tokenizer, vocab, always=tokenizer.all_special_ids, limit=args.limit)
    sources = ", ".join(filter(None, [args.corpus and f"corpus:{args.corpus} (train)", *args.prompts]))
    save_ranking(args.out, ranking, model=args.model, sources=sources, documents=str(len(texts)))
    print(f"{args.out}: {ranking.numel()} ids ranked from {len(texts)} documents ({sources})")


if __name__ == "__main__":
    main()
