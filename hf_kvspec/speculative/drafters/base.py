"""The drafter protocol: what the speculative loop asks of every assistant, and what it tells it back.

Boundary: data classes exchanged between the loop and a drafter, plus the ``Assistant`` base class. A drafter
owns its own state (a draft model's cache, an n-gram index, a head's features) and rolls it back itself; it
never touches the target's cache, except a self-drafter (``shares_target_cache``, below).

One round, seen from a drafter:
    1. ``propose(ctx)``: return ``DraftProposal`` with N draft tokens per row. A chain leaves ``parents=None``;
       a tree (Medusa/EAGLE) fills ``parents`` (topological order, ``-1`` = child of the last committed token),
       and the loop verifies it with the same functions (``verify.py``).
       ``probs=None`` declares the drafts deterministic (point mass: greedy draft, n-gram, top-k heads), which is
       exact under sampling too; a stochastic drafter returns the processed distribution it sampled from,
       computed with ``ctx.process`` so that temperature/top-k/top-p/penalties match the target's.
    2. The loop verifies and calls ``observe(outcome)``: how many columns of ``ctx.tokens`` survive (the
       drafter crops its own state to that), per-row accepted counts, and, when the drafter set
       ``wants_hidden_states``, the target's last hidden states of the round (for feature-level drafters).
    3. When rows of the batch have finished and the drafter implements ``release``, ``release(rows)`` names them by
       row id (a row's index in the caller's batch, fixed for the call); the drafter drops their state, and later
       contexts and outcomes hold only the other rows, in the same order (see ``rows.py``). ``staying(rows)`` gives
       the positions of the rows that stay, for re-indexing batched state.

Self-speculation (the target drafts for itself: early exit, layer skipping, a sparse KV view): a drafter that sets
``shares_target_cache`` gets the target's own cache as ``ctx.target_cache`` (the loop creates a ``DynamicCache``
before the first round when ``generate`` passed none). It may write draft positions there, layer by layer (per-layer
lengths, cache contract C2/C3), but when ``propose`` returns, every layer must hold either the verified columns
only (the cache as the loop left it: the drafter cropped what it wrote, ``contract.crop_layers``) or, when the
drafter also implements ``verify_forward``, whatever that hook expects to find. ``verify_forward(model, inputs,
cache, feature_layers)`` replaces the loop's ``model(**inputs, cache=cache)`` for the round's verify forward: it
gets the same kwargs (``input_ids`` [A, T], ``attention_mask`` 2D or None, ``position_ids`` [A, T],
``logits_to_keep``) and returns ``(logits [A, logits_to_keep, V], features [A, logits_to_keep, F] | None)``,
features only when ``feature_layers`` is not None; afterwards every layer of the cache must hold the columns
``model(**inputs)`` would have left there, so the loop's roll back (crop / keep_positions) applies unchanged.

Shapes: ``B`` rows, ``W`` buffer width, ``N`` draft tokens (nodes), ``V`` vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_kvspec.speculative.autok import AutoDraftLength, is_count

if TYPE_CHECKING:
    from hf_kvspec.speculative.buffer import TokenBuffer
    from hf_kvspec.speculative.positions import History, PositionwiseProcessor


@dataclass
class DraftContext:
    """What the loop shows a drafter before a round."""

    buffer: TokenBuffer  # cache-aligned tokens/mask/positions [B, W]; last column not yet seen by the target
    history: History  # rows as plain generate sees them (for processors and n-gram lookup)
    num_draft_tokens: int  # N requested this round (already capped by the remaining length)
    do_sample: bool
    alive: torch.Tensor  # [B] bool rows still generating
    processor: PositionwiseProcessor  # generate's logits processors, position by position
    # the target's own cache, for a drafter with ``shares_target_cache`` (None for every other drafter); between
    # rounds every layer holds the buffer's first W - 1 columns (the prompt was prefilled before the first round)
    target_cache: object | None = None
    # the deepest path worth drafting this round: ``max_depth`` drafts and the next token fill the tokens left to
    # generate (tree drafters keep their width near the end; the loop cuts deeper proposals). None = no limit
    max_depth: int | None = None

    def process(self, logits: torch.Tensor, drafted: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Processed float32 scores [B, T, V] of draft ``logits`` [B, T, V]: position t follows each row's
        history and ``drafted[:, :start + t]``, exactly as the target's scores at that position are processed."""
        return self.processor(self.history, drafted, logits, start)


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [B, N] draft token ids
    probs: torch.Tensor | None = None  # [B, N, V] distribution each token was drawn from; None = point mass
    parents: torch.Tensor | None = None  # [N] tree topology shared by all rows, or [B, N] per row; None = chain
    draft_forwards: int = 0  # model forward passes spent on this proposal (telemetry)


class ChainDraft:
    """A chain drafted one token at a time from a drafter's logits, processed exactly as the target's scores are.

    Each ``next(logits)`` processes ``logits`` [B, 1, V] after each row's history and the tokens drafted so far, then
    samples (keeping the distribution, for exact rejection sampling) when ``ctx.do_sample`` and ``sample``, else
    takes the argmax. ``proposal()`` is the ``DraftProposal`` of the chain. ``generator``: where the draws come
    from (an engine request's own; None: torch's default).
    """

    def __init__(self, ctx: DraftContext, empty: torch.Tensor, sample: bool = True,
                 generator: torch.Generator | None = None):
        self.ctx, self.sample, self.generator = ctx, sample and ctx.do_sample, generator
        self.empty = empty  # [B, 0] int64: the drafted prefix before the first token
        self.tokens: list[torch.Tensor] = []  # [B] each
        self.probs: list[torch.Tensor] = []  # [B, V] each, when sampling

    def drafted(self) -> torch.Tensor:  # [B, n]
        return torch.stack(self.tokens, dim=1) if self.tokens else self.empty

    def next(self, logits: torch.Tensor) -> torch.Tensor:
        """The next draft token [B] after ``logits`` [B, 1, V]."""
        from hf_kvspec.speculative.verify import sample_tokens

        scores = self.ctx.process(logits, self.drafted(), start=len(self.tokens))[:, 0]  # [B, V]
        if self.sample:
            dist = torch.softmax(scores, dim=-1)
            token = sample_tokens(dist, self.generator)
            self.probs.append(dist)
        else:
            token = scores.argmax(dim=-1)
        self.tokens.append(token)
        return token

    def proposal(self) -> DraftProposal:
        return DraftProposal(self.drafted(), torch.stack(self.probs, dim=1) if self.probs else None,
                             draft_forwards=len(self.tokens))


@dataclass
class RoundOutcome:
    """What the loop tells a drafter after verifying its proposal."""

    kept_width: int  # columns of the buffer that remain valid in every cache (the target now holds this many)
    num_accepted: torch.Tensor  # [B] draft tokens each row kept
    alive: torch.Tensor  # [B] bool rows that were generating in this round (rows that finished earlier may stay)
    num_draft_tokens: int  # N that was verified
    draft_time_s: float
    verify_time_s: float
    # target's last-layer hidden states (when ``wants_hidden_states``): chain [B, N + 1, H] over the round; tree
    # [B, 1 + max(num_accepted), H] along each row's accepted path, root first. Either way row i's newest feature,
    # the one that produced its next token, is ``target_hidden[i, num_accepted[i]]``
    target_hidden: torch.Tensor | None = None
    # [B, D] node index of each accepted draft token along row i's path, -1 past num_accepted[i] (for a chain
    # 0, 1, ...); a tree drafter keeps the same nodes of its own state
    accepted_nodes: torch.Tensor | None = None
    # [B] the call-row index of each row (rows keep it when finished rows leave the batch); None: 0..B-1
    call_rows: list[int] | None = None


class Assistant(abc.ABC):
    """Base class of every assistant passed as ``generate(..., assistant=...)``: the protocol the loop reads.

    Every capability and option the loop reads is declared here, typed, with its default; the loop reads nothing
    else. Subclasses implement ``propose``; they override ``begin``/``observe``/``end`` when they keep state.
    ``num_draft_tokens`` is an int or ``"auto"`` (see ``autok.AutoDraftLength``). Telemetry goes back to the caller
    through the loop's return value (``output.acceptance``), never through attributes of the assistant.
    """

    #: the loop captures the target's features (the outputs of ``feature_layers``, concatenated) in the prefill and
    #: in every verify forward, and passes them to ``begin`` and in ``RoundOutcome.target_hidden``
    wants_hidden_states: bool = False
    #: target layers whose outputs make the features (``-1`` = the last decoder layer), when ``wants_hidden_states``
    feature_layers: tuple[int, ...] = (-1,)
    #: ``propose`` may return trees: the loop checks at the start of the call that the target's attention takes a
    #: custom 4D mask and that the cache keeps a tree's path (a tree proposed without this flag is checked when it
    #: arrives)
    proposes_trees: bool = False
    #: self-speculation: the loop passes the target's cache as ``DraftContext.target_cache`` (module docstring)
    shares_target_cache: bool = False
    #: the loop calls ``verify_forward`` for the round's verify forward instead of calling the model itself
    runs_verify_forward: bool = False
    #: acceptance under sampling: ``"exact"`` (speculative sampling, the loop's) or the name of the assistant's own
    #: rule, which the loop then applies through ``verify`` and records as ``lossy_rule`` in ``output.acceptance``
    acceptance: str = "exact"
    #: the name recorded for a lossy ``acceptance`` (None: a generic name is recorded)
    lossy_rule: str | None = None
    #: an hf_kvspec attention the target must run while this assistant drafts (``"kvspec_quant"``); the loop
    #: switches the target to it for the call and back (``speculative/call_attention.py``); None: the loop's rule
    call_attention: str | None = None

    def __init__(self, num_draft_tokens: int | str = 4, max_draft_tokens: int = 16):
        if num_draft_tokens != "auto" and not is_count(num_draft_tokens, minimum=0):
            raise ValueError(f"num_draft_tokens must be a non-negative int or 'auto', got {num_draft_tokens!r}")
        if not is_count(max_draft_tokens, minimum=1):  # checked without "auto" too
            raise ValueError(f"max_draft_tokens must be a positive int, got {max_draft_tokens!r}")
        self.num_draft_tokens: int | str = num_draft_tokens
        self.max_draft_tokens: int = max_draft_tokens  # most nodes a proposal holds (sizes the caches' checks)
        self.auto = AutoDraftLength(max_draft_tokens=max_draft_tokens) if num_draft_tokens == "auto" else None
        self.row_ids: list[int] = []  # the call's rows, by id, in batch order (``begin``, ``staying``)

    def check_target(self, target, cache) -> None:  # noqa: B027 - optional hook, most assistants fit any target
        """Called before the call's first forward with the target and the caller's cache (None: the loop makes a
        ``DynamicCache``): refuse (``ValueError`` naming the fix) what this assistant cannot do with them, so that
        nothing is found out after a forward."""

    def begin(self, target, buffer: TokenBuffer, target_hidden: torch.Tensor | None = None) -> None:
        """Called once per ``generate`` call, after the prefill and before the first round; resets per-call state (an
        ``"auto"`` draft length keeps what it measured in earlier calls with as many rows: costs and acceptance carry
        over). The target's cache holds the prompt; the buffer holds the prompt and the first token (its last
        column). ``target_hidden`` [B, P', F] are the prefill's features when ``wants_hidden_states`` (``P'`` prompt
        columns the prefill fed: fewer than the prompt when a caller's cache held the rest)."""
        self.row_ids = list(range(buffer.tokens.shape[0]))
        if self.auto is not None:
            self.auto.start_call(buffer.tokens.shape[0])

    def draft_length(self) -> int:
        """N for the next round (the loop caps it by the tokens left to generate)."""
        return self.auto.choose() if self.auto is not None else self.num_draft_tokens

    @abc.abstractmethod
    def propose(self, ctx: DraftContext) -> DraftProposal:
        """Draft ``ctx.num_draft_tokens`` tokens per row (``ctx.num_draft_tokens >= 1``)."""

    def observe(self, outcome: RoundOutcome) -> None:
        """Roll back own state to ``outcome.kept_width`` columns; update the auto draft length."""
        if self.auto is not None:
            self.auto.update(outcome)

    def release(self, rows: list[int]) -> None:  # noqa: B027 - a drafter declares it releases rows by overriding
        """Rows ``rows`` (row ids) finished and leave the batch: drop their state (re-index batched state with
        ``staying(rows)``). Later contexts and outcomes hold the other rows, in the same order. The loop lets
        finished rows leave only for a drafter that overrides this (``releases_rows``); for any other, finished
        rows stay in the batch to the end of the call (fed holes), so per-row state it keeps stays aligned."""

    def spawn(self) -> Assistant:
        """An assistant for one more sequence: drafting as this one does, sharing its models and options, with call
        state of its own and no draft-length tuner (its caller gives each round's K in ``DraftContext``). The
        serving engine holds one per request for an assistant it has no batched drafter for (a one-row
        ``begin``/``propose``/``observe``/``end`` each, ``serving/drafting.py``). Default: a shallow copy, which is
        right when ``begin`` builds every piece of per-call state afresh; override it otherwise."""
        twin = copy.copy(self)
        twin.auto, twin.row_ids = None, []
        return twin

    def staying(self, rows: list[int]) -> torch.Tensor:
        """For ``release``: the positions ``[A]`` (a CPU tensor) of the rows that stay among the current ones, in
        order; the released ids are forgotten."""
        gone = set(rows)
        keep = [i for i, row in enumerate(self.row_ids) if row not in gone]
        self.row_ids = [self.row_ids[i] for i in keep]
        return torch.tensor(keep, dtype=torch.long)

    def verify_forward(self, model, inputs: dict, cache, feature_layers: tuple[int, ...] | None):
        """The round's verify forward, when ``runs_verify_forward`` (module docstring): ``(logits [B, T, V],
        features [B, T, F] | None)`` for the loop's ``inputs``."""
        raise NotImplementedError(f"{type(self).__name__} sets runs_verify_forward but does not define verify_forward")

    def verify(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor, parents: torch.Tensor | None,
               generator: torch.Generator | None = None):
        """The assistant's own acceptance rule under sampling (``acceptance != "exact"``): ``draft_tokens`` [B, N],
        ``target_probs`` [B, N + 1, V], ``parents`` [N] | [B, N] | None -> ``verify.VerifyResult``."""
        raise NotImplementedError(f"{type(self).__name__}(acceptance={self.acceptance!r}) defines no verify rule")

    def kernel_modules(self) -> tuple:
        """Models this drafter runs whose small-row linear calls may use the loop's decode kernels
        (``hf_kvspec.kernels.linear``); none by default."""
        return ()

    def end(self) -> None:  # noqa: B027 - optional hook, stateless drafters keep the no-op
        """Called once when the ``generate`` call finishes: drop per-call state (caches)."""

    def report(self) -> dict | None:
        """What the drafter ran on and holds (e.g. its forward and the bytes of its weight copies), recorded in
        ``output.acceptance.drafter``; None when there is nothing to say."""
        return None


class PlainDecoding(Assistant):
    """Drafts nothing: ``speculative_generate(assistant=None)`` decodes one token per round through the same loop
    and forwards (plain decoding on the fast forward, and the baseline speculation is measured against)."""

    def __init__(self):
        super().__init__(num_draft_tokens=0)

    def propose(self, ctx: DraftContext) -> DraftProposal:
        raise AssertionError("PlainDecoding drafts nothing: the loop never asks it for a proposal (N = 0)")


def releases_rows(assistant: Assistant) -> bool:
    """Whether ``assistant`` declares that finished rows may leave its batch (it overrides ``release``)."""
    return type(assistant).release is not Assistant.release


def __getattr__(name: str):
    if name == "Drafter":  # the base's name before it took the word the API uses (generate(assistant=...))
        import warnings

        warnings.warn("hf_kvspec Drafter is now Assistant; the old name will be removed", FutureWarning, stacklevel=2)
        return Assistant
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
