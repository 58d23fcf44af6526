"""One forward over ragged rows: packs a round's scheduled rows into a single sequence (batch 1, per-token
``position_ids``), runs the unmodified transformers model on it and returns the logits the round samples from.

Boundary: input building and the forward only. What to run comes from ``scheduler.py``; K/V storage and the
packed layout's bookkeeping are ``RaggedPagedCache``'s; attention over the rows is ``attention.py``
(``kvspec_ragged``), to which the model is switched for the duration of the forward only, so the model stays
usable by ``generate`` and everything else between rounds. Committing or rolling back the round's K/V is the
caller's (``cache.end_forward``), once the round's tokens are chosen.

Layout of a round with rows a (decode), b (prefill chunk of 3), c (decode):

    input_ids     [[ a5 | b0 b1 b2 | c9 ]]     T = 5 packed columns
    position_ids  [[  5 |  0  1  2 |  9 ]]     each row's own positions
    logits rows      a5 (col 0), b2 (col 3) if b's chunk ends its prompt, c9 (col 4)

Speculation: ``ForwardRow`` is the general row — draft tokens appended after a decode row's real token, with
tree positions and a tree mask among the new tokens, and logits at every node — so the verify rows of several
requests share one packed run with decode and prefill rows (``speculation.py`` builds them); the target's
features of every column come back too when a drafter reads them (``forward_with_features``).

Shape legend: T packed tokens of the round · K logits rows kept · V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from hf_kvspec import _compat
from hf_kvspec.cache.ragged import RaggedPagedCache, RaggedRow
from hf_kvspec.forward.runner import kernels_apply
from hf_kvspec.speculative.drafters.features import FeatureCapture

from .attention import ATTN_NAME, RaggedAttend
from .scheduler import ScheduledRow


@contextmanager
def ragged_attention_switched(model):
    """The model attends with ``kvspec_ragged`` inside the block and with what it had before, after (a no-op when
    it already does: the switch walks every module, so a serving loop holds it across rounds)."""
    previous = _compat.attn_implementation(model.config)
    if previous == ATTN_NAME:
        yield
        return
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@dataclass(frozen=True)
class ForwardRow:
    """One sequence's part of a packed forward, in the most general form the runner takes.

    A scheduled row feeds consecutive tokens and wants the last one's logits; a speculative verify row (the
    seam for drafters) appends draft tokens with tree positions and a tree mask and wants logits at every node.
    """

    seq_id: int
    token_ids: Sequence[int]  # the new tokens, n of them
    start: int  # tokens of the sequence already stored
    positions: Sequence[int] | None = None  # n position ids; None: start .. start + n - 1
    new_token_mask: torch.Tensor | None = None  # [n, n] bool among the new tokens; None: causal
    logits_at: tuple[int, ...] = ()  # indices into token_ids whose logits the forward returns

    @classmethod
    def scheduled(cls, row: ScheduledRow) -> ForwardRow:
        tokens = row.request.tokens[row.start: row.start + row.num_tokens]
        return cls(row.request.request_id, tokens, row.start, logits_at=(row.num_tokens - 1,) if row.samples else ())


def _fast_forward(model, fast: bool | None):
    """The model's fast forward (``hf_kvspec.forward``), or None where the engine runs the model's own."""
    from hf_kvspec.forward.runner import choose_forward

    forward = choose_forward(model, fast)
    return forward if forward.name == "fast" else None


def _kernels_for(model):
    """A (not yet opened) ``DecodeKernels`` over ``model`` that routes only inside ``routing()`` blocks and shares
    the kernel choices ``speculative_generate`` remembers on disk."""
    from hf_kvspec.kernels.linear import DecodeKernels, default_plans_file

    return DecodeKernels(model, route_on_enter=False, plans_file=default_plans_file())


class ForwardRunner:
    """Builds the packed inputs of a round and runs the model over them.

    Args:
        model, cache: the model and its ``RaggedPagedCache``.
        reference: attend through ``kvspec_ragged``'s plain row-by-row reference and keep torch's stock linear
            kernels (slow; the oracle the fast path is tested against).
        decode_kernels: route the forward's ``F.linear`` calls through ``hf_kvspec.DecodeKernels`` (prepacked
            weights: a round's few decode rows and its few logits rows, the LM head above all, run faster than
            with stock MKL, which repacks the weight per call). ``None``: on for fp32 models on CPU that do not run
            the fast forward, unless ``reference``. Outputs differ from stock only by fp32 summation order.
        fast_forward: run the packed forward on ``hf_kvspec.forward``'s fast forward (packed weight copies; the
            model's own forward stays the reference): ``None`` where it applies and pays, ``True`` or an error
            naming why not, ``False`` never. Off under ``reference``.
    """

    def __init__(self, model, cache: RaggedPagedCache, reference: bool = False, decode_kernels: bool | None = None,
                 fast_forward: bool | None = None):
        self.model, self.cache = model, cache
        self.device = model.device
        self.reference = reference
        self.fast = None if reference or fast_forward is False else _fast_forward(model, fast_forward)
        if decode_kernels is None:
            decode_kernels = not reference and self.fast is None and kernels_apply(model)
        self.kernels = _kernels_for(model) if decode_kernels else None

    def pack(self, rows: Sequence[ForwardRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [1, T], position_ids [1, T], logits_columns [K])`` of the rows, in row order."""
        ids, positions, logits_columns = [], [], []
        for row in rows:
            logits_columns += [len(ids) + i for i in row.logits_at]
            ids += row.token_ids
            positions += row.positions if row.positions is not None else range(row.start, row.start + len(row.token_ids))
        return self._long([ids]), self._long([positions]), self._long(logits_columns)

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def forward(self, rows: Sequence[ForwardRow]) -> torch.Tensor:  # [K, V]
        """Forward the rows (each ``reserve``d); their new K/V are written, uncommitted until the caller's
        ``cache.end_forward``. Returns the logits asked for by ``logits_at``, row by row."""
        return self.forward_with_features(rows)[0]

    def forward_with_features(self, rows: Sequence[ForwardRow], feature_layers: Sequence[int] | None = None):
        """``forward``, also returning the target's features ``[T, F]`` of every packed column (the outputs of
        ``feature_layers``, for drafters that read them; ``None`` without layers)."""
        input_ids, position_ids, logits_columns = self.pack(rows)
        self.cache.begin_forward([RaggedRow(r.seq_id, r.start, len(r.token_ids), r.new_token_mask) for r in rows],
                                 self.device, reference=self.reference)
        if self.fast is not None:  # attends through RaggedAttend: the model's attention stays as it is
            with torch.no_grad():
                logits, features = self.fast.run(input_ids, position_ids, RaggedAttend(self.cache, self.fast.scaling),
                                                 logits_columns, feature_layers)
            return logits[0], None if features is None else features[0]
        capture = FeatureCapture(self.model, feature_layers) if feature_layers else nullcontext()
        # no_grad, not inference_mode: pages made inside inference mode could not be copied (copy-on-write) outside it
        with torch.no_grad(), ragged_attention_switched(self.model), self._kernels(routing=True), capture:
            out = self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True,
                             logits_to_keep=logits_columns)
        return out.logits[0], capture.features()[0] if feature_layers else None

    @contextmanager
    def held_across_rounds(self, attention: bool = True):
        """Keep what every forward sets up and tears down — the switch to ``kvspec_ragged`` and the open decode
        kernels, each of which walks the model's modules — in place for the rounds run inside the block (a serving
        loop, ``Engine.generate_batch``). With ``attention`` the model attends with ``kvspec_ragged`` inside the
        block, so nothing else may run the model there: an engine whose drafters may run the target (a draft model
        that is the target, self-drafting) holds the kernels only (``Engine.hold_rounds``). The fast forward attends
        without the switch, so it is held only for the model's own forward."""
        held = attention and self.fast is None
        with ragged_attention_switched(self.model) if held else nullcontext(), self._kernels():
            yield

    @contextmanager
    def _kernels(self, routing: bool = False):
        """The decode kernels open (a no-op without them); ``routing``: also route ``F.linear`` calls."""
        if self.kernels is None:
            yield
            return
        with self.kernels, (self.kernels.routing() if routing else nullcontext()):
            yield

    def run(self, rows: Sequence[ScheduledRow]) -> torch.Tensor:  # [K, V]
        """A round's scheduled rows; logits of the rows that sample, in order."""
        return self.forward([ForwardRow.scheduled(row) for row in rows])
