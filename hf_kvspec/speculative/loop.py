"""The speculative decode loop, exposed as a ``custom_generate`` callable for ``model.generate``.

Boundary: owns the target's forward passes and the caller's cache; asks a drafter for tokens, the verifier for
decisions, the stopper where rows end. Knows nothing about how drafts are made.

    model.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=DraftModelAssistant(draft))

Each round reads as named phases, the same for chains and trees (``rounds.py`` holds what differs): draft ->
verify forward (one target forward over the last token + N drafts; a chain's first round also feeds the prompt, so
there is no separate prefill forward, as in transformers' assisted decoding; a tree gets a 4D mask and root + depth
positions) -> accept (verifier on scores processed along each draft's own path) -> stop (EOS, stop strings, max
length, per row) -> roll back / keep the path (a chain crops the target cache to the longest kept path, a tree keeps
each row's accepted path with ``cache.contract.keep_positions``; see ``buffer.py`` for the holes of shorter rows) ->
emit (history, streamer, scores, telemetry). Which rows the model still sees is ``rows.py``'s business. Greedy
output is token-identical to ``generate(do_sample=False)``; sampled output has exactly the distribution of
``generate(do_sample=True)`` (Leviathan et al. 2211.17192).

Shapes: ``B`` rows, ``P`` prompt length, ``N`` draft tokens this round, ``V`` vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.generation import GenerateDecoderOnlyOutput

from hf_kvspec import _compat
from hf_kvspec.speculative.buffer import TokenBuffer
from hf_kvspec.speculative.drafters.base import Drafter, DraftProposal, RoundOutcome
from hf_kvspec.speculative.drafters.features import FeatureCapture
from hf_kvspec.speculative.positions import History, PositionwiseProcessor, PositionwiseStopper
from hf_kvspec.speculative.rollback import check_cache, prepare_for_rollback
from hf_kvspec.speculative.rounds import cap_depth, check_tree_attention, is_tree, plan_round
from hf_kvspec.speculative.rows import ActiveRows
from hf_kvspec.speculative.stats import AcceptanceStats
from hf_kvspec.speculative.verify import sample_tokens

# generate's model kwargs the loop consumes itself (it computes masks and positions per round)
_HANDLED_KWARGS = {"attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep"}
_MAX_ROUND_SLACK = 64


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the call's ``AcceptanceStats``."""

    acceptance: AcceptanceStats | None = None


def speculative_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         assistant: Drafter | None = None, decode_kernels: bool | None = None,
                         synced_gpus: bool = False,
                         **model_kwargs):
    """``custom_generate`` entry point: ``model.generate(..., custom_generate=speculative_generate, assistant=A)``.

    ``generate`` has already built the processors, stopping criteria, attention mask and cache; this function
    replaces only its decoding loop. Returns what ``generate`` returns (a ``SpeculativeGenerateOutput`` with
    ``.acceptance`` when ``return_dict_in_generate=True``).

    ``decode_kernels`` (default None: on for a target with fp32 weights on CPU, off elsewhere): runs the few-row
    fp32 linear calls of the target and of the drafter's models (verify forwards, draft forwards) through the
    fastest measured kernel (``hf_kvspec.kernels``): a weight packed once is read once per forward whatever its row
    count, which is what makes verifying drafts cost about one decode step on a CPU. Same math in another summation
    order (outputs may differ in the last bits); weight copies held beside the model within a memory budget,
    reported with the kernel chosen per row bucket in ``output.acceptance.kernels``. The routing is scoped to this
    call and thread (a ``TorchFunctionMode``); the model's modules are never changed. ``False`` keeps torch's stock
    kernels (the reference) and never imports ``hf_kvspec.kernels``; ``True`` asks for them wherever they apply.
    """
    if assistant is None:
        raise ValueError("speculative_generate needs an assistant: generate(..., custom_generate="
                         "hf_kvspec.speculative_generate, assistant=hf_kvspec.NgramAssistant()) or a "
                         "DraftModelAssistant(draft_model).")
    if synced_gpus:
        raise NotImplementedError("speculative_generate does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP).")
    decoder = SpeculativeDecoder(model, assistant, logits_processor, stopping_criteria, generation_config,
                                 streamer=_compat.generate_call_streamer())
    if decode_kernels is None:
        decode_kernels = kernels_apply(model)
    if not decode_kernels:
        return decoder.run(input_ids, model_kwargs)
    from hf_kvspec.kernels.linear import DecodeKernels, default_plans_file

    drafting = [module for module in assistant.kernel_modules() if isinstance(module, torch.nn.Module)]
    with DecodeKernels(model, *drafting, route_on_enter=False, plans_file=default_plans_file()) as kernels:
        decoder.kernels = kernels
        try:
            return decoder.run(input_ids, model_kwargs)
        finally:
            decoder.stats.kernels = kernels.report()


def kernels_apply(model) -> bool:
    """True when the decode kernels can help ``model``: fp32 weights on CPU, not being compiled."""
    weight = next(model.parameters(), None)
    return (weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
            and not torch.compiler.is_compiling())


class SpeculativeDecoder:
    """State of one speculative ``generate`` call."""

    def __init__(self, model, assistant, logits_processor, stopping_criteria, generation_config, streamer=None):
        _check_inputs(model, assistant, generation_config)
        self.model = model
        self.assistant = assistant
        self.config = generation_config
        self.do_sample = bool(generation_config.do_sample)
        self.processor = PositionwiseProcessor(logits_processor)
        self.stopper = PositionwiseStopper(stopping_criteria)
        self.streamer = streamer
        self.stats = AcceptanceStats()
        self.kernels = None  # the decode kernels' context (speculative_generate sets it when they are on)
        self.pad_token_id = _compat.generation_pad_token_id(generation_config)
        self.record_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.record_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        # sampling with a drafter's own (lossy) acceptance rule, asked for by name: acceptance="typical"
        self.rule = assistant.verify if self.do_sample and getattr(assistant, "acceptance", "exact") != "exact" \
            else None
        # target layers a feature drafter reads (hooks keep only those: features.FeatureCapture)
        self.feature_layers = tuple(getattr(assistant, "feature_layers", (-1,))) \
            if assistant.wants_hidden_states else None

    # ------------------------------------------------------------------------------------------ driver
    def _check_cache_capabilities(self) -> None:
        """Before any forward: the cache rolls back, keeps a tree's path of up to ``max_draft_tokens`` nodes (+ the
        root) when the drafter proposes trees, and crops layer ranges when it drafts on the target's own cache."""
        trees = bool(getattr(self.assistant, "proposes_trees", False))
        nodes = int(getattr(self.assistant, "max_draft_tokens", 16))
        check_cache(self.cache, keep_positions=trees, per_layer=bool(getattr(self.assistant, "shares_target_cache", False)),
                    segment=nodes + 1 if trees else None)

    def run(self, input_ids: torch.Tensor, model_kwargs: dict):
        self.cache = model_kwargs.get("cache")
        self._check_cache_capabilities()
        self.sliding = prepare_for_rollback(self.cache)
        _check_kwargs(model_kwargs)
        batch = input_ids.shape[0]
        if batch > 1 and (self.sliding or _has_sliding_layers(self.model.config)):
            raise NotImplementedError(
                "speculative_generate with batch size > 1 does not support sliding-window attention layers: rows "
                "that accept fewer draft tokens keep masked slots, which would shift each row's window. Run the "
                "rows one at a time (batch size 1).")
        self.alive = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        self.rows = ActiveRows(batch, input_ids.device)
        self.compact_rows = batch > 1 and _may_drop_rows(self.cache, self.assistant)
        if self.cache is None and self.assistant.shares_target_cache:  # a self-drafter writes into it from round 1
            self.cache = DynamicCache(config=self.model.config)
        if self.assistant.proposes_trees:
            _check_tree_support(self.model, self.sliding)
        self.buffer = TokenBuffer(input_ids, model_kwargs.get("attention_mask"), self.pad_token_id)
        # room for every token plus one round's drafts past max_length (History grows if a caller needs more)
        capacity = (self.config.max_length or input_ids.shape[1] + 256) + _MAX_ROUND_SLACK
        self.history = History(input_ids, capacity, self.pad_token_id)
        self.score_rows = [[] for _ in range(batch)] if self.record_scores else None
        self.logit_rows = [[] for _ in range(batch)] if self.record_logits else None
        self.streamed = input_ids.shape[1]
        self.fed = self.cache.get_seq_length() if self.cache is not None else 0  # buffer columns in the cache
        if self.rule is not None:  # lossy rules are recorded by name in output.acceptance
            self.stats.lossy_rules.append(getattr(self.assistant, "lossy_rule", None) or
                                          f"{type(self.assistant).__name__} acceptance={self.assistant.acceptance!r}")
        # feature-level drafters need the prompt's hidden states before their first draft: separate prefill;
        # otherwise the prompt is verified together with the first round's drafts (one target forward saved)
        hidden = self._prefill(input_ids) if self.assistant.wants_hidden_states else None
        self.assistant.begin(self.model, self.buffer, target_hidden=hidden)
        try:
            while bool(self.alive.any()):
                self._round()
        finally:
            self.assistant.end()
        self._stream(final=True)
        self.assistant.stats = self.stats
        return self._output()

    def _prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Prompt forward (as generate's) and the first token; returns the prompt's features [B, P, F] (the
        drafter's ``feature_layers``, concatenated)."""
        past = self.fed
        with FeatureCapture(self.model, self.feature_layers) as capture:
            out = self.model(input_ids=input_ids[:, past:], attention_mask=self.buffer.attention_mask(1),
                             position_ids=self.buffer.positions[:, past:], cache=self.cache, use_cache=True,
                             logits_to_keep=1)
        self.cache = out.cache if self.cache is None else self.cache
        none = input_ids.new_zeros(input_ids.shape[0], 0)
        scores = self.processor(self.history, none, out.logits[:, -1:])  # [B, 1, V]
        token = self._pick(scores[:, 0])
        counts = self.alive.long()
        keep, stopped = self.stopper.keep(self.history, token[:, None], counts)
        self._record(scores, out.logits[:, -1:], torch.zeros_like(scores[..., 0], dtype=torch.long), keep)
        self.history.append(token[:, None], keep)
        self.buffer.append_round(none, torch.zeros_like(counts), token, self.alive)
        self.alive = self.alive & ~stopped
        self.fed = self.buffer.width - 1
        self.stats.prefill_forwards += 1
        self._stream()
        return capture.features()

    def _pick(self, scores: torch.Tensor) -> torch.Tensor:
        # scores [B, V] -> [B], from the same distribution as generate's _sample picks a token
        if self.do_sample:
            return sample_tokens(torch.softmax(scores, dim=-1))
        return scores.argmax(dim=-1)

    # ------------------------------------------------------------------------------------------ one round
    def _round(self) -> None:
        """draft -> verify forward -> accept -> roll back / keep the path -> emit; chains and trees alike
        (``rounds.py`` holds what differs). History, processors, verifier and stopper see all ``B`` rows; the
        buffer, caches and drafter the ``A`` active ones (``rows.py``)."""
        alive, rows = self.alive, self.rows
        prompt_tokens = self.buffer.width - 1 - self.fed  # > 0 only in a first round that also prefills
        start = time.perf_counter()
        plan = plan_round(rows.full_proposal(self._draft()))  # draft: [B, N], a chain or a tree
        drafted = _now(plan.proposal.tokens)
        with self._routing(plan):
            logits, hidden = self._verify_forward(plan)  # verify forward: [B, N + 1, V]; hidden [A, N + 1, H]
        scores = plan.scores(self.processor, self.history, logits)  # each node processed after its own path
        result = plan.verify(scores, self.do_sample, self.rule)  # accept
        verified = _now(logits)
        emitted, keep, stopped = self._commit(plan, result, scores, logits, alive)  # [B, D + 1]

        longest = int(result.num_accepted[alive].max())
        nodes = self._keep_path(plan, result, emitted, alive, longest)  # roll back / keep the path
        self.alive = alive & ~stopped
        hidden = plan.path_hidden(hidden, nodes, longest)
        self._telemetry(plan, result, keep, alive, hidden, drafted - start, verified - drafted, prompt_tokens)
        self._stream()  # emit
        self._drop_finished_rows()

    def _commit(self, plan, result, scores, logits, alive):
        """Emitted tokens ``[B, D + 1]`` (accepted path, then the next token at ``num_accepted``), committed to the
        history up to each row's stop; returns them with the kept counts [B] and the rows that stopped [B]."""
        emitted = torch.cat([result.accepted_tokens(plan.proposal.tokens), result.next_tokens[:, None]], dim=1)
        emitted.scatter_(1, result.num_accepted[:, None], result.next_tokens[:, None])
        keep, stopped = self.stopper.keep(self.history, emitted, (result.num_accepted + 1) * alive)
        self._record(scores, logits, _score_positions(result), keep)
        self.history.append(emitted, keep)
        return emitted, keep, stopped

    def _keep_path(self, plan, result, emitted, alive, longest: int) -> torch.Tensor:
        """Target cache and buffer keep each row's accepted path (``longest`` columns; shorter rows get masked
        holes) and its next token; returns the active rows' accepted nodes [A, D]."""
        nodes, num_accepted, next_tokens, live = self.rows.take_all(result.accepted_nodes, result.num_accepted,
                                                                    result.next_tokens, alive)
        plan.keep(self.cache, self.buffer.width - 1, nodes, longest, self.sliding)
        self.buffer.append_round(self.rows.take(emitted)[:, :longest], num_accepted, next_tokens, live)
        self.fed = self.buffer.width - 1
        return nodes

    def _drop_finished_rows(self) -> None:
        """Take rows that stopped out of the model's batch (cache, buffer, drafter), when the cache is ours."""
        if self.compact_rows and bool(self.alive.any()):
            self.stats.rows_dropped += self.rows.leave(self.alive, self.buffer, self.cache, self.assistant)

    def _draft(self) -> DraftProposal:
        """The drafter's proposal for the active rows ``[A, N]``, capped by the tokens left to generate: a path of
        ``room - 1`` drafts plus the next token fills the room, so a chain is cut to ``room - 1`` tokens and a tree
        to depth ``room - 1`` (it keeps its width near ``max_new_tokens``)."""
        max_depth = max(self._room() - 1, 0)
        num_draft = self.assistant.draft_length()
        if not self.assistant.proposes_trees:
            num_draft = min(num_draft, max_depth)
        if num_draft <= 0 or max_depth == 0:
            return DraftProposal(self.buffer.tokens.new_zeros(self.buffer.tokens.shape[0], 0))
        ctx = self.rows.draft_context(self.buffer, self.history, self.processor, self.alive, num_draft,
                                      self.do_sample, max_depth,
                                      self.cache if self.assistant.shares_target_cache else None)
        proposal = self.assistant.propose(ctx)
        if is_tree(proposal):
            _check_tree_support(self.model, self.sliding)
        return cap_depth(proposal, max_depth)

    def _room(self) -> int:
        """Most tokens any live row may still add (max_length counts the prompt, as in generate)."""
        if self.stopper.max_length is None:
            return 1 << 30
        return int((self.stopper.max_length - self.history.lengths[self.alive]).max())

    def _routing(self, plan):
        """The decode kernels' routing around a verify forward of several rows (drafts, or more than one live
        sequence), where a weight read once pays; a one-row plain step runs stock (routing costs about what it
        would save there)."""
        rows = (plan.proposal.tokens.shape[1] + 1) * int(self.alive.sum())
        return self.kernels.routing() if self.kernels is not None and rows > 1 else contextlib.nullcontext()

    def _verify_forward(self, plan):
        """One target forward over the columns the cache lacks and the drafts (inputs from ``plan``); returns the
        full batch's logits [B, N + 1, V] and, for feature drafters, the active rows' features [A, N + 1, F] of
        the root and the drafts (captured with hooks on the layers the drafter reads, not
        ``output_hidden_states``, which would keep every layer's output of the forward)."""
        if plan.is_tree and self.fed < self.buffer.width - 1:
            self._feed_prompt()  # a tree's 4D mask covers the root and the nodes only
        inputs = plan.forward_inputs(self.buffer, self.fed, self.rows, self.cache, self.model.dtype)
        if self.assistant.verify_forward is not None:  # a self-drafter runs the target's layers itself
            logits, hidden = self.assistant.verify_forward(self.model, inputs, self.cache, self.feature_layers)
            return self.rows.expand(logits), hidden
        if self.feature_layers is None:
            out = self.model(**inputs, cache=self.cache, use_cache=True)
            hidden = None
        else:
            with FeatureCapture(self.model, self.feature_layers) as capture:
                out = self.model(**inputs, cache=self.cache, use_cache=True)
            hidden = capture.features()[:, -inputs["logits_to_keep"]:]
        self.cache = out.cache if self.cache is None else self.cache
        return self.rows.expand(out.logits), hidden

    def _feed_prompt(self) -> None:
        """Put the buffer's columns before the root into the cache (a first round verifying a tree)."""
        mask = self.buffer.mask[:, :-1] if self.buffer.has_holes else None
        out = self.model(input_ids=self.buffer.tokens[:, self.fed:-1], attention_mask=mask,
                         position_ids=self.buffer.positions[:, self.fed:-1], cache=self.cache, use_cache=True,
                         logits_to_keep=1)
        self.cache = out.cache if self.cache is None else self.cache
        self.fed = self.buffer.width - 1

    # ------------------------------------------------------------------------------------------ emit
    def _record(self, scores, logits, positions, keep) -> None:
        # scores/logits [B, T, V]; positions [B, T] which score row produced emitted token j; keep [B]
        for store, values in ((self.score_rows, scores), (self.logit_rows, logits)):
            if store is None:
                continue
            picked = values.gather(1, positions[..., None].expand(-1, -1, values.shape[-1]))
            for row, count in enumerate(keep.tolist()):
                store[row].append(picked[row, :count].float())

    def _telemetry(self, plan, result, keep, alive, hidden, draft_s, verify_s, prompt_tokens) -> None:
        # per position j of a chain, per depth j + 1 of a tree
        num_draft = plan.num_draft
        accepted = result.num_accepted[alive]
        per_position = [int((accepted > j).sum()) for j in range(plan.depth)]
        self.stats.record_round(num_draft, int(alive.sum()), int(keep.sum()), per_position, draft_s, verify_s,
                                plan.proposal.draft_forwards, depth=plan.depth)
        num_accepted, live, nodes = self.rows.take_all(result.num_accepted, alive, result.accepted_nodes)
        self.assistant.observe(RoundOutcome(self.buffer.width - 1, num_accepted, live, num_draft, draft_s, verify_s,
                                            hidden, prompt_tokens, accepted_nodes=nodes))

    def _stream(self, final: bool = False) -> None:
        """Hand the streamer every column that all live rows have completed (only final tokens)."""
        if self.streamer is None:
            return
        lengths = torch.where(self.alive, self.history.lengths, self.history.lengths.max())
        ready = int(self.history.lengths.max() if final else lengths.min())
        if ready > self.streamed:
            ids = self.history.ids[:, self.streamed:ready]
            if ids.shape[0] == 1:
                self.streamer.put(ids[0].cpu())
            else:
                for col in range(ids.shape[1]):
                    self.streamer.put(ids[:, col].cpu())
            self.streamed = ready
        if final:
            self.streamer.end()

    def _output(self):
        sequences = self.history.sequences()
        if not self.config.return_dict_in_generate:
            return sequences
        steps = sequences.shape[1] - self.history.prompt_len
        return SpeculativeGenerateOutput(
            sequences=sequences, scores=_per_step(self.score_rows, steps), logits=_per_step(self.logit_rows, steps),
            cache=None if self.compact_rows else self.cache, acceptance=self.stats)


def _score_positions(result) -> torch.Tensor:
    # emitted token j of a chain was scored at position j (the root for j = 0, then after node j - 1)
    nodes = result.accepted_nodes  # [B, N]; N = 0 in a round that drafted nothing (still one emitted token)
    return torch.cat([nodes.new_zeros(nodes.shape[0], 1), torch.where(nodes >= 0, nodes + 1, 0)], dim=1)


def _per_step(rows: list[list[torch.Tensor]] | None, steps: int):
    """Per-row score lists -> generate's tuple of ``steps`` tensors [B, V] (zeros after a row stopped)."""
    if rows is None:
        return None
    stacked = [torch.cat(chunks) for chunks in rows]  # each [T_row, V]
    vocab = stacked[0].shape[-1]
    out = torch.zeros(len(rows), steps, vocab, dtype=stacked[0].dtype, device=stacked[0].device)
    for row, values in enumerate(stacked):
        out[row, : values.shape[0]] = values
    return tuple(out.unbind(1))


def _may_drop_rows(cache, assistant: Drafter) -> bool:
    """Finished rows may leave the batch (``rows.py``) only from a plain ``DynamicCache`` that ``generate`` made for
    this call (a caller's cache keeps its rows; ``generate`` keeps static caches on the model for later calls;
    offloading layers prefetch across calls' layers) and with a drafter that re-indexes its own state."""
    if not assistant.can_drop_rows:
        return False
    if cache is None:  # the first forward creates a DynamicCache
        return True
    return (type(cache) is DynamicCache and not getattr(cache, "offloading", False)
            and not _compat.cache_is_user_defined(cache)
            and all(callable(getattr(layer, "batch_select_indices", None)) for layer in cache.layers))


def _now(tensor: torch.Tensor) -> float:
    if tensor.device.type == "cuda":  # honest timings for the auto draft length
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


def _check_tree_support(model, sliding: bool) -> None:
    """Trees need a custom 4D mask through the target's attention and no sliding windows (the mask replaces them)."""
    check_tree_attention(_compat.attn_implementation(model.config))
    if sliding or _has_sliding_layers(model.config):
        raise NotImplementedError("tree verification does not support sliding-window attention layers: the tree's "
                                  "4D mask would replace the window. Use a chain drafter (e.g. tree='chain').")


def _has_sliding_layers(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any("sliding" in str(kind) for kind in layer_types)
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _check_inputs(model, assistant, generation_config) -> None:
    if not isinstance(assistant, Drafter):
        raise TypeError(f"assistant must be an hf_kvspec Drafter (DraftModelAssistant, NgramAssistant, ...), got "
                        f"{type(assistant).__name__}. For a bare draft model use DraftModelAssistant(model).")
    if model.config.is_encoder_decoder:
        raise NotImplementedError("speculative_generate supports decoder-only models.")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("speculative_generate does not do beam search; use num_beams=1.")


def _check_kwargs(model_kwargs: dict) -> None:
    unknown = {k for k, v in model_kwargs.items() if v is not None and k not in _HANDLED_KWARGS}
    if unknown:
        raise ValueError(f"speculative_generate does not forward these generate kwargs to the model: "
                         f"{sorted(unknown)}. Pass input_ids/attention_mask (decoder-only text models).")
