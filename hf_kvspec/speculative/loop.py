"""The speculative decode loop, exposed as a ``custom_generate`` callable for ``model.generate``.

Boundary: owns the target's forward passes and the caller's cache; asks an assistant for drafts, the verifier for
decisions, the row state where rows end. Knows nothing about how drafts are made.

    model.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=DraftModelAssistant(draft))

A call is one prefill forward over the prompt (the first token, and the prompt's features for an assistant that
reads them), then rounds until no row generates. Each round reads as named phases, the same for chains and trees
(``rounds.py`` holds what differs): draft -> verify forward (one target forward over the root + N drafts; a tree
gets a 4D mask and root + depth positions) -> accept (verifier on scores processed along each draft's own path) ->
stop (EOS, stop strings, max length, per row) -> roll back / keep the path (a chain crops the target cache to the
longest kept path, a tree keeps each row's accepted path with ``cache.contract.keep_positions``; see ``buffer.py``
for the holes of shorter rows) -> emit (history, streamer, scores, telemetry). The prefill's first token takes the
same accept and emit steps as a round that drafted nothing. Rounds see the active rows only (``rows.py``).
Greedy output is token-identical to ``generate(do_sample=False)``; sampled output has exactly the distribution of
``generate(do_sample=True)`` (Leviathan et al. 2211.17192).

Shapes: ``A`` active rows, ``P`` prompt length, ``N`` draft tokens this round, ``V`` vocabulary, ``F`` features.
"""

from __future__ import annotations

import contextlib
import time

import torch

from hf_kvspec import _compat
from hf_kvspec.forward.runner import kernels_apply
from hf_kvspec.speculative.buffer import TokenBuffer
from hf_kvspec.speculative.call_attention import call_attention as switched_attention
from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal, PlainDecoding, RoundOutcome
from hf_kvspec.speculative.in_use import exclusive_use
from hf_kvspec.speculative.output import CallOutput, SpeculativeGenerateOutput
from hf_kvspec.speculative.positions import History, PositionwiseProcessor, PositionwiseStopper
from hf_kvspec.speculative.preflight import (
    call_forward,
    check_call,
    check_entry,
    check_inputs,
    check_kwargs,
    check_tree_support,
    rows_may_leave,
)
from hf_kvspec.speculative.round import RoundVerdict, accept, keep_columns
from hf_kvspec.speculative.rounds import cap_proposal, is_tree, plan_round
from hf_kvspec.speculative.rows import ActiveRows
from hf_kvspec.speculative.stats import AcceptanceStats

__all__ = ["SpeculativeDecoder", "SpeculativeGenerateOutput", "speculative_generate"]

_MAX_ROUND_SLACK = 64  # history columns past max_length: one round's drafts


def speculative_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         assistant: Assistant | None = None, decode_kernels: bool | None = None,
                         call_attention: bool | None = None, fast_forward: bool | None = None,
                         synced_gpus: bool = False, **model_kwargs):
    """``custom_generate`` entry point: ``model.generate(..., custom_generate=speculative_generate, assistant=A)``.

    ``generate`` has built the processors, stopping criteria, mask and cache; this replaces its decoding loop and
    returns what it returns (with ``.acceptance`` when ``return_dict_in_generate=True``). ``assistant=None``
    decodes plainly (one token per round) through the same loop and forwards.

    ``fast_forward`` (default None: on for an fp32 Llama-family target on CPU whose layers are large enough for
    weight reads to bound a step, with a ``DynamicCache``): the target's prefill and verify forwards run
    ``hf_kvspec.forward``'s fast forward over packed weight copies (fused, transposed; about the model's size,
    reported in ``output.acceptance.forward``) instead of the model's own forward. Same math in another
    summation order (outputs may differ in the last bits, as with the decode kernels). ``False`` keeps the model's
    forward (the reference); ``True`` asks for it and raises naming why where it does not apply.

    ``decode_kernels`` (default None: on for fp32 weights on CPU): the few-row fp32 linear calls of the drafter's
    models (and of the target where the fast forward does not run it) go through the fastest measured kernel
    (``hf_kvspec.kernels``; weight copies within a memory budget, reported in ``output.acceptance.kernels``; the
    routing is scoped to this call and thread, the modules never change). ``False``: torch's stock kernels.

    ``call_attention`` (default None: on for a target running ``sdpa`` with grouped K/V heads): runs the call on
    ``kvspec_gqa``, which reads each K/V head once where sdpa copies it per query head under a mask (every verify
    forward), or on the attention the assistant declares (``Assistant.call_attention``); switched back when the
    call ends (``call_attention.py``). ``False`` keeps the target's attention (the reference).
    """
    check_entry(assistant, logits_processor, stopping_criteria, generation_config)
    if synced_gpus:
        raise NotImplementedError("speculative_generate does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP).")
    assistant = PlainDecoding() if assistant is None else assistant
    decoder = SpeculativeDecoder(model, assistant, logits_processor, stopping_criteria, generation_config,
                                 streamer=_compat.generate_call_streamer(), cache=model_kwargs.get("cache"),
                                 fast_forward=fast_forward)
    if decode_kernels is None:
        decode_kernels = kernels_apply(model)
    previous = _compat.attn_implementation(model.config)
    with switched_attention(model, call_attention, assistant.call_attention) as switched:
        decoder.stats.attention = f"{switched} (switched from {previous} for this call)" if switched else None
        return _run_with_kernels(decoder, decode_kernels, input_ids, model_kwargs)


def _run_with_kernels(decoder: SpeculativeDecoder, decode_kernels: bool, input_ids, model_kwargs: dict):
    """``decoder.run`` with the decode kernels routing the linear calls of the drafter's modules (and of the target,
    unless the fast forward runs it: that packs its own weights), when they are on."""
    drafting = [module for module in decoder.assistant.kernel_modules() if isinstance(module, torch.nn.Module)]
    routed = drafting if decoder.forward.name == "fast" else [decoder.model, *drafting]
    if not (decode_kernels and routed):
        return decoder.run(input_ids, model_kwargs)
    from hf_kvspec.kernels.linear import DecodeKernels, default_plans_file  # looked up per call (tests swap it)

    with DecodeKernels(*routed, route_on_enter=False, plans_file=default_plans_file()) as kernels:
        decoder.kernels = kernels
        try:
            return decoder.run(input_ids, model_kwargs)
        finally:
            decoder.stats.kernels = kernels.report()


class SpeculativeDecoder:
    """One speculative ``generate`` call: prefill, then rounds until no row generates (module docstring)."""

    def __init__(self, model, assistant: Assistant, logits_processor, stopping_criteria, generation_config,
                 streamer=None, cache=None, fast_forward: bool | None = False):
        check_inputs(model, assistant, generation_config)
        self.forward = call_forward(model, assistant, cache, fast_forward)  # who runs the target's forwards
        self.model, self.assistant, self.config = model, assistant, generation_config
        self.do_sample = bool(generation_config.do_sample)
        self.processor = PositionwiseProcessor(logits_processor)
        self.stopper = PositionwiseStopper(stopping_criteria)
        self.streamer = streamer
        self.stats = AcceptanceStats()
        self.kernels = None  # the decode kernels' context (speculative_generate sets it when they are on)
        # sampling with an assistant's own (lossy) acceptance rule, asked for by name: acceptance="typical"
        self.rule = assistant.verify if self.do_sample and assistant.acceptance != "exact" else None
        self.feature_layers = tuple(assistant.feature_layers) if assistant.wants_hidden_states else None

    # ------------------------------------------------------------------------------------------ driver
    def run(self, input_ids: torch.Tensor, model_kwargs: dict):
        """The whole call, holding the assistant for its duration: another call that runs the same instance at the
        same time is refused (``in_use.py``)."""
        with exclusive_use(self.assistant):
            return self._run(input_ids, model_kwargs)

    def _run(self, input_ids: torch.Tensor, model_kwargs: dict):
        check_kwargs(model_kwargs)
        self.cache = model_kwargs.get("cache")
        batch, prompt_len = input_ids.shape
        self.sliding = check_call(self.model, self.cache, self.assistant, batch, self.stopper.max_length)
        pad = _compat.generation_pad_token_id(self.config)
        self.buffer = TokenBuffer(input_ids, model_kwargs.get("attention_mask"), pad)
        capacity = (self.config.max_length or prompt_len + 256) + _MAX_ROUND_SLACK  # History grows if needed
        self.rows = ActiveRows(History(input_ids, capacity, pad), self.processor, self.stopper,
                               may_leave=batch > 1 and rows_may_leave(self.cache, self.assistant))
        self.output = CallOutput(self.config, self.streamer, batch, prompt_len)
        if self.rule is not None:  # lossy rules are recorded by name in output.acceptance
            self.stats.lossy_rules.append(self.assistant.lossy_rule or
                                          f"{type(self.assistant).__name__} acceptance={self.assistant.acceptance!r}")
        hidden = self._prefill(input_ids)
        self.assistant.begin(self.model, self.buffer, target_hidden=hidden)
        try:
            while self.rows.any_alive:
                self._round()
        finally:
            self.assistant.end()
            self.stats.drafter, self.stats.forward = self.assistant.report(), self.forward.report()
        self.output.stream(self.rows.full, self.rows.call_alive(), final=True)
        return self.output.result(self.rows.full, None if self.rows.may_leave else self.cache, self.stats)

    def _prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """One forward over the prompt columns the cache lacks; commits the first token like a round that drafted
        nothing; returns the prompt's features [A, P', F] when the assistant reads them."""
        past = _cached_prompt(self.cache, input_ids.shape[1])
        inputs = dict(input_ids=input_ids[:, past:], attention_mask=self.buffer.attention_mask(1),
                      position_ids=self.buffer.positions[:, past:], logits_to_keep=1)
        logits, features = self._forward(inputs)  # [A, 1, V], [A, P - past, F]
        plan, alive = plan_round(DraftProposal(input_ids[:, :0])), self.rows.alive
        result = self._accept(plan, logits)[0].result
        self.buffer.append_round(input_ids[:, :0], result.num_accepted, result.next_tokens, alive)
        self.stats.prefill_forwards += 1
        self.output.stream(self.rows.full, self.rows.call_alive())
        return features

    # ------------------------------------------------------------------------------------------ one round
    def _round(self) -> None:
        """draft -> verify forward -> accept -> roll back / keep the path -> emit; chains and trees alike
        (``rounds.py`` holds what differs), over the active rows (rows that finished in the last round or in the
        prefill leave first, when they may)."""
        self.stats.rows_dropped += self.rows.leave(self.buffer, self.cache, self.assistant)  # rows that finished
        alive = self.rows.alive  # [A] rows generating in this round
        start = time.perf_counter()
        plan = plan_round(self._draft())  # draft: [A, N], a chain or a tree
        drafted = _now(plan.proposal.tokens)
        with self._routing((plan.proposal.tokens.shape[1] + 1) * int(alive.sum())):
            logits, hidden = self._verify_forward(plan)  # verify forward: [A, N + 1, V]; hidden [A, N + 1, F]
        verified = _now(logits)
        verdict, kept = self._accept(plan, logits)  # accept, stop, commit
        result, longest = verdict.result, int(verdict.result.num_accepted[alive].max())  # roll back / keep the path
        keep_columns(self.cache, self.buffer.width - 1, verdict.kept[:, :longest + 1], new=plan.num_draft + 1,
                     tree=plan.is_tree, sliding=self.sliding)
        self.buffer.append_round(verdict.emitted[:, :longest], result.num_accepted, result.next_tokens, alive)
        hidden = plan.path_hidden(hidden, result.accepted_nodes, longest)
        self._telemetry(plan, result, kept, alive, hidden, drafted - start, verified - drafted)
        self.output.stream(self.rows.full, self.rows.call_alive())  # emit

    def _draft(self) -> DraftProposal:
        """The assistant's proposal ``[A, N]``, capped by the tokens left to generate: a path of ``room - 1`` drafts
        plus the next token fills the room, so a chain is cut to ``room - 1`` tokens and a tree to depth
        ``room - 1`` (it keeps its width near ``max_new_tokens``)."""
        max_depth = max(self.rows.room(self.stopper.max_length) - 1, 0)
        num_draft = self.assistant.draft_length()
        if not self.assistant.proposes_trees:
            num_draft = min(num_draft, max_depth)
        if num_draft <= 0 or max_depth == 0:
            return DraftProposal(self.buffer.tokens[:, :0])
        target_cache = self.cache if self.assistant.shares_target_cache else None
        ctx = DraftContext(self.buffer, self.rows.history, num_draft, self.do_sample, self.rows.alive,
                           self.rows.process, target_cache=target_cache, max_depth=max_depth)
        with self._routing(int(self.rows.alive.sum())):
            proposal = self.assistant.propose(ctx)
        if is_tree(proposal):
            check_tree_support(self.model, self.sliding)
        return cap_proposal(proposal, max_depth)

    def _routing(self, rows: int):
        """The decode kernels' routing around a forward or a drafting call over ``rows`` token rows (a verify
        forward's drafts, or several live sequences), where a weight read once for all rows pays; a one-row step
        runs stock (routing costs about what it would save there)."""
        return self.kernels.routing() if self.kernels is not None and rows > 1 else contextlib.nullcontext()

    def _verify_forward(self, plan):
        """One target forward over the root and the drafts (inputs from ``plan``): logits [A, N + 1, V] and, for
        an assistant that reads features, those of the root and the drafts [A, N + 1, F]."""
        inputs = plan.forward_inputs(self.buffer, self.cache, self.model.dtype)
        if self.assistant.runs_verify_forward:  # a self-drafter runs the target's layers itself
            return self.assistant.verify_forward(self.model, inputs, self.cache, self.feature_layers)
        return self._forward(inputs)

    def _forward(self, inputs: dict):
        """The target's forward on its cache (``self.forward``: the fast forward or the model's own) -> (logits,
        features of every fed column | None): the outputs of the layers the assistant reads only."""
        logits, features, self.cache = self.forward(inputs, self.cache, self.feature_layers)
        return logits, features

    def _accept(self, plan, logits: torch.Tensor) -> tuple[RoundVerdict, torch.Tensor]:
        """Verify ``plan`` against ``logits`` [A, N + 1, V] (``round.accept``) and commit each row's emitted tokens
        (accepted path, then the next token) up to its stop; returns the verdict and the kept counts [A]."""
        rows = self.rows
        verdict = accept(plan, rows.process, rows.history, logits, self.do_sample, self.rule)
        kept, stopped = rows.keep(verdict.emitted, verdict.counts * rows.alive)
        self.output.record(rows.call_rows(), verdict.scores, logits, verdict.score_rows, kept)
        rows.commit(verdict.emitted, kept, stopped)
        return verdict, kept

    def _telemetry(self, plan, result, kept, alive, hidden, draft_s: float, verify_s: float) -> None:
        # acceptance per position j of a chain, per depth j + 1 of a tree
        accepted = result.num_accepted[alive]
        per_position = [int((accepted > j).sum()) for j in range(plan.depth)]
        self.stats.record_round(plan.num_draft, int(alive.sum()), int(kept.sum()), per_position, draft_s, verify_s,
                                plan.proposal.draft_forwards, depth=plan.depth)
        self.assistant.observe(RoundOutcome(self.buffer.width - 1, result.num_accepted, alive, plan.num_draft,
                                            draft_s, verify_s, hidden, accepted_nodes=result.accepted_nodes,
                                            call_rows=self.rows.call_rows()))


def _cached_prompt(cache, prompt_len: int) -> int:
    """Prompt columns a caller's cache holds already (the prefill feeds the rest). A cache holding the whole prompt
    is cropped by one column: the prefill needs the last prompt token's logits."""
    held = cache.get_seq_length() if cache is not None else 0
    if held >= prompt_len:
        cache.crop(prompt_len - 1 - held)
        return prompt_len - 1
    return held


def _now(tensor: torch.Tensor) -> float:
    if tensor.device.type == "cuda":  # honest timings for the auto draft length
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()
