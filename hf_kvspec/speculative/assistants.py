"""Build an assistant from a short spec string (the CLI's ``--assistant`` and the benchmarks).

Boundary: maps names to drafter constructors; knows nothing about the decode loop.

    ngram                   NgramAssistant(max_ngram=3)
    suffix                  SuffixAssistant(): drafts from a pool of the rows' own text and everything the assistant
                            saw before (trees of the most frequent continuations; in the engine one pool per
                            engine, each request reading its own salt's tenant)
    draft:<dir>             DraftModelAssistant(AutoModelForCausalLM.from_pretrained(<dir>)): a causal LM directory
                            with the target's tokenizer
    draft:truncated:<N>     DraftModelAssistant(truncated_draft(target, N)): the target's first N layers + final
                            norm + LM head (the stand-in until a trained drafter exists)
    early_exit[:E]          EarlyExitAssistant(E): the target's first E layers on its own cache (E defaults to L // 2)
    layer_skip              LayerSkipAssistant("search"): the target with a searched skip set
    sparse_kv[:W]           SparseKVAssistant(view="streaming", window=W): the target over 4 sink tokens and the
                            last W (default 256) committed tokens of its own cache (long contexts)
    lookahead[:W[:N[:G]]]   LookaheadAssistant(window=W, ngram=N, guesses=G): Lookahead decoding, the target only
                            (defaults 5, 4, 5); num_draft_tokens "auto" sizes each round, an int caps its nodes
    self-int8 | self-int4   QuantizedSelfAssistant(target, weights="int8"|"int4"): the target drafts from a
                            weight-only quantized copy of its own linear layers (fp32 Llama-family targets on CPU)

``check_spec`` parses a spec without loading anything (the CLI calls it before the model loads); ``~`` in a
directory is expanded.

The trained heads shipped for the bundled model are built by ``make_head_assistant`` (the CLI's ``--assistant
medusa|eagle``), with their own options (tree, draft vocabulary) checked by ``check_head_options``:

    medusa                  MedusaAssistant(load_bundled_heads("medusa"))   (small tree, auto size, draft vocab)
    eagle                   EagleAssistant(load_bundled_heads("eagle"))     (dynamic tree, auto size; the EAGLE-3
                            head's own trained 8,192-token draft vocabulary)
"""

from __future__ import annotations

from pathlib import Path

ASSISTANT_HELP = ("ngram | suffix | self-int8 | self-int4 | draft:<causal LM dir> | draft:truncated:<N layers of the target> | "
                  "early_exit[:E] | layer_skip | sparse_kv[:window] | lookahead[:W[:N[:G]]]")
HEAD_ASSISTANTS = ("medusa", "eagle")
TREES = ("default", "small", "chain", "dynamic")


def check_head_options(kind: str, tree: str | None = None, draft_vocab_size: int | str | None = None) -> str:
    """Check a bundled-head assistant's options without loading anything; returns the tree to use (``None``:
    the assistant's own default). ``draft_vocab_size``: an int, ``"full"`` (the whole vocabulary) or ``None`` (the
    shipped draft vocabulary, ``draft_vocab.SHIPPED_SIZE`` ids)."""
    if kind not in HEAD_ASSISTANTS:
        raise ValueError(f"bundled heads are {' or '.join(HEAD_ASSISTANTS)}, got {kind!r}")
    tree = tree or ("small" if kind == "medusa" else "dynamic")
    if tree not in TREES:
        raise ValueError(f"tree must be one of {', '.join(TREES)}, got {tree!r}")
    if tree == "dynamic" and kind == "medusa":
        raise ValueError("a dynamic tree is grown from EAGLE's own draft confidence; Medusa takes default, small or "
                         "chain (or use --assistant eagle)")
    if draft_vocab_size not in (None, "full") and (isinstance(draft_vocab_size, bool)
                                                   or not isinstance(draft_vocab_size, int) or draft_vocab_size < 1):
        raise ValueError(f"draft_vocab_size must be a positive int or 'full', got {draft_vocab_size!r}")
    trained = _trained_draft_vocab(kind) if isinstance(draft_vocab_size, int) else None
    if trained:
        raise ValueError(f"the bundled {kind} head drafts over the {trained}-token vocabulary it was trained with "
                         "(EAGLE-3); a ranked draft vocabulary applies to heads without one: drop --draft-vocab-size "
                         "(or use --assistant medusa)")
    return tree


def _trained_draft_vocab(kind: str) -> int | None:
    """The bundled head's own draft-vocabulary size from its config.json (read, not loaded), or None."""
    import json

    from hf_kvspec.heads.bundled import bundled_heads_path

    return json.loads((bundled_heads_path(kind) / "config.json").read_text()).get("draft_vocab_size")


def make_head_assistant(kind: str, target, tree: str | None = None, num_draft_tokens: int | str | None = None,
                        draft_vocab_size: int | str | None = None):
    """``MedusaAssistant``/``EagleAssistant`` over the heads shipped for the bundled model (attached to ``target``
    on the first call, pairing checked); ``num_draft_tokens`` None = the tree's size, or ``"auto"``."""
    tree = check_head_options(kind, tree, draft_vocab_size)
    from hf_kvspec.heads.bundled import load_bundled_heads
    from hf_kvspec.speculative.drafters.eagle import EagleAssistant
    from hf_kvspec.speculative.drafters.medusa import MedusaAssistant

    heads = load_bundled_heads(kind, dtype=target.dtype)
    assistant = MedusaAssistant if kind == "medusa" else EagleAssistant
    vocab = {None: "shipped", "full": None}.get(draft_vocab_size, draft_vocab_size)
    size = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}  # None: the default, auto
    return assistant(heads, tree=tree, draft_vocab_size=vocab, **size)


def check_spec(spec: str) -> tuple[str, int | Path | None]:
    """Parse ``spec`` without loading anything: ``("ngram", None)``, ``("truncated", N)``, ``("draft", dir)``,
    ``("lookahead", (W, N, G) or a prefix of it)``, ...

    The one grammar for ``make_assistant`` and the CLI's early check; raises naming what is wrong. The upper bound
    of ``N`` (the target's layer count) is checked by ``truncated_draft`` once the target is loaded.
    """
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a string: ngram | draft:<dir> | draft:truncated:<N>, got {type(spec).__name__}")
    if spec in ("ngram", "suffix"):
        return spec, None
    if spec == "layer_skip":  # LayerSkipAssistant("search"): the skip set measured on the first prompt
        return "layer_skip", None
    if spec in ("self-int8", "self-int4"):  # QuantizedSelfAssistant(target, weights="int8" | "int4")
        return "self", spec.removeprefix("self-")
    if spec == "early_exit" or spec.startswith("early_exit:"):  # EarlyExitAssistant(E); E defaults to L // 2
        layers = spec.removeprefix("early_exit").removeprefix(":")
        if spec != "early_exit" and (not layers.isdigit() or int(layers) < 1):
            raise ValueError(f"early_exit:<E> needs a positive exit layer, got {spec!r}")
        return "early_exit", int(layers) if layers else None
    if spec == "sparse_kv" or spec.startswith("sparse_kv:"):  # SparseKVAssistant(window=W); W defaults to 256
        window = spec.removeprefix("sparse_kv").removeprefix(":")
        if spec != "sparse_kv" and (not window.isdigit() or int(window) < 1):
            raise ValueError(f"sparse_kv:<window> needs a positive number of recent tokens, got {spec!r}")
        return "sparse_kv", int(window) if window else None
    if spec == "lookahead" or spec.startswith("lookahead:"):  # LookaheadAssistant(W, N, G)
        return "lookahead", _lookahead_sizes(spec)
    if spec.startswith("draft:"):
        return _check_draft_spec(spec)
    raise ValueError(f"Unknown assistant {spec!r}; use {ASSISTANT_HELP}")


def _check_draft_spec(spec: str) -> tuple[str, int | Path]:
    """``draft:truncated:<N>`` -> ``("truncated", N)``; ``draft:<dir>`` -> ``("draft", dir)``."""
    if spec.startswith("draft:truncated:"):
        layers = spec.removeprefix("draft:truncated:")
        if not layers.isdigit():
            raise ValueError(f"draft:truncated:<N> needs a layer count, got {spec!r}")
        if int(layers) < 1:
            raise ValueError(f"draft:truncated:<N> needs at least 1 layer, got {spec!r}")
        return "truncated", int(layers)
    if not spec.removeprefix("draft:"):
        raise ValueError("draft:<dir> needs the directory of a saved causal LM, e.g. draft:./my-draft")
    path = Path(spec.removeprefix("draft:")).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"{spec}: not a model directory (no config.json); save one with save_pretrained()")
    return "draft", path


def default_draft_tokens(spec: str) -> int | str:
    """K a spec's assistant gets when none is asked for (``hf-kvspec generate --assistant SPEC`` without
    ``--num-draft-tokens``, the benchmarks' defaults): Lookahead sizes its own rounds; a quantized copy of the
    target agrees with it so often that long chains pay (measured on the bundled model: tau ~7.5 of 8 for int8);
    the suffix pool cuts each draft to what its counts support, so it is given room (8 nodes); 4 otherwise."""
    if spec.startswith("lookahead"):
        return "auto"
    return {"self-int8": 8, "self-int4": 6, "suffix": 8}.get(spec, 4)


def default_assistant(spec: str, target):
    """The assistant ``hf-kvspec generate --assistant SPEC`` builds with no other option: a bundled head with its
    own defaults, or ``make_assistant`` at ``default_draft_tokens(spec)`` (what the benchmarks compare)."""
    if spec in HEAD_ASSISTANTS:
        return make_head_assistant(spec, target)
    return make_assistant(spec, target, default_draft_tokens(spec))


def make_assistant(spec: str, target, num_draft_tokens: int | str = 4):
    """The drafter named by ``spec`` for ``target``; ``num_draft_tokens`` is K or ``"auto"``."""
    from torch import nn

    from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant
    from hf_kvspec.speculative.drafters.ngram import NgramAssistant

    kind, value = check_spec(spec)
    if not isinstance(target, nn.Module):
        raise TypeError(f"make_assistant needs the loaded target model the drafter will serve, got "
                        f"{type(target).__name__}.")
    if kind == "ngram":
        return NgramAssistant(max_ngram=3, num_draft_tokens=num_draft_tokens)
    if kind == "suffix":
        from hf_kvspec.speculative.drafters.suffix import SuffixAssistant

        return SuffixAssistant(num_draft_tokens=8 if num_draft_tokens == "auto" else num_draft_tokens)
    if kind == "lookahead":
        from hf_kvspec.speculative.drafters.lookahead import LookaheadAssistant

        return LookaheadAssistant(*value, num_draft_tokens=num_draft_tokens)
    if kind in ("early_exit", "layer_skip", "sparse_kv"):
        return _self_drafter(kind, value, target, num_draft_tokens)
    if kind == "self":
        from hf_kvspec.speculative.drafters.quantized_self import QuantizedSelfAssistant

        return QuantizedSelfAssistant(target, weights=value, num_draft_tokens=num_draft_tokens)
    if kind == "truncated":
        from hf_kvspec.speculative.drafters.truncated import truncated_draft

        return DraftModelAssistant(truncated_draft(target, value), num_draft_tokens=num_draft_tokens)
    return DraftModelAssistant(_load_draft(value, target), num_draft_tokens=num_draft_tokens)


def _lookahead_sizes(spec: str) -> tuple[int, ...]:
    """``lookahead[:W[:N[:G]]]`` -> the sizes given, in order (the others keep LookaheadAssistant's defaults)."""
    parts = spec.split(":")[1:]
    minimums = (("window W", 1), ("ngram N", 2), ("guesses G", 0))
    if len(parts) > 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"lookahead[:W[:N[:G]]] takes up to three ints (window, n-gram length, guesses), got {spec!r}")
    for part, (name, minimum) in zip(parts, minimums):
        if int(part) < minimum:
            raise ValueError(f"{spec}: {name} must be >= {minimum}")
    return tuple(int(p) for p in parts)


def parse_num_draft_tokens(value: str) -> int | str:
    """``"auto"`` or a non-negative int (argparse ``type=``)."""
    if value == "auto":
        return value
    if not value.isdigit():
        raise ValueError(f"--num-draft-tokens takes an int or 'auto', got {value!r}")
    return int(value)


def _self_drafter(kind: str, value: int | None, target, num_draft_tokens: int | str):
    from hf_kvspec.speculative.drafters.early_exit import EarlyExitAssistant
    from hf_kvspec.speculative.drafters.layer_skip import LayerSkipAssistant
    from hf_kvspec.speculative.drafters.sparse_kv import SparseKVAssistant

    if kind == "sparse_kv":
        return SparseKVAssistant(view="streaming", window=value or 256, num_draft_tokens=num_draft_tokens)
    if kind == "layer_skip":
        return LayerSkipAssistant("search", num_draft_tokens=num_draft_tokens)
    exit_layer = value or max(target.config.num_hidden_layers // 2, 1)
    return EarlyExitAssistant(exit_layer, num_draft_tokens=num_draft_tokens)


def _load_draft(path: Path, target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device).eval()
