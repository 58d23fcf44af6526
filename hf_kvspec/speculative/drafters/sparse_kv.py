"""Self-speculation at long context: the target drafts for itself over a cheap view of its own KV cache.

Boundary: a ``Assistant`` that runs the *target* model as its own draft, reading a view of the target's cache that
the loop hands over (``shares_target_cache``; ``DraftContext.target_cache``). It never writes the target's cache:
every round it opens a fresh view, drafts, and drops the view; verification is the loop's plain target forward
over the full cache, so greedy output is token-identical to plain ``generate`` and sampled output has its exact
distribution (Leviathan et al. 2211.17192) whatever the view.

Views (``view=``):
    "streaming"   StreamingLLM sinks + window of the committed columns (MagicDec, Sadhukhan et al. 2408.11049):
                  ``hf_kvspec.cache.views.StreamingView``, rebuilt each round from ``sink_tokens + window``
                  columns of the target's cache (DynamicCache, StaticCache, PagedCache). A draft step reads
                  ``sink_tokens + window + d`` keys per layer instead of the whole context.
    "quantized"   the whole context as KIVI codes (QuantSpec, Tiwari et al. 2502.10424, reads a 4-bit view of the
                  same cache): a ``QuantizedKVCache`` *shadow* of the committed columns, read by the fused
                  ``kvspec_quant`` attention (the target must run it: ``enable_quantized_attention(model)``,
                  which is plain SDPA over any other cache, so the verify pass is the unchanged target).

Storage choice for "quantized" (byte arithmetic in ``hf_kvspec.memory.quantized_view_bytes``): verification is
exact only against the target's own full-precision K/V, and ``QuantizedKVCache`` keeps only codes plus a short
window, so a verify pass over it would not be the plain target. The target therefore keeps its full-precision
cache and the drafter keeps the codes beside it (``b + 32/G`` bits per element, 4.5/32 = 14% of fp32 at b=4,
G=64, plus the shadow's full-precision window). QuantSpec's hierarchical 4+4-bit split avoids the second copy
only for a target *defined* on an 8-bit cache; we do not redefine the target. New committed columns are copied
into the shadow after every round (read from the target's cache, so the shadow holds the verified K/V, not the
draft's); the draft's own tokens go into the shadow's full-precision window and are cropped before returning,
which the crop rule makes exact when ``residual_length >= max_draft_tokens + group_size - 1``
(``QuantizedKVCache.check_keep_capacity``).

Shapes: ``B`` rows, ``W`` buffer width, ``K`` draft tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

from hf_kvspec.cache.views import StreamingView, check_readable, read_columns
from hf_kvspec.speculative.drafters.base import Assistant, ChainDraft, DraftContext, DraftProposal
from hf_kvspec.speculative.drafters.view_costs import ViewBytes, model_weight_bytes, touches_per_step, view_bytes

VIEWS = ("streaming", "quantized")
#: acceptance per draft assumed before any round was verified, per view (``autok.AutoDraftLength.set_priors``);
#: lower than most measured (docs/long_context.md), so the priors do not overpromise
PRIOR_ACCEPTANCE = {"streaming": 0.7, "quantized": 0.8}
_QUANTIZED_TARGET = ("SparseKVAssistant(view='quantized') keeps the codes itself beside the target's full-precision "
                     "cache; a QuantizedKVCache target would be verified over codes, which is not the plain target. "
                     "Pass a DynamicCache (or PagedCache), or no cache.")


class SparseKVAssistant(Assistant):
    """``SparseKVAssistant(view="streaming", sink_tokens=4, window=256, num_draft_tokens=4)``: the target drafts
    over a cheap view of its own cache (module docstring). ``num_draft_tokens`` is K or ``"auto"``.

    ``view="quantized"`` takes ``bits`` / ``group_size`` / ``residual_length`` of the shadow ``QuantizedKVCache``
    (its defaults: KIVI 4-bit, G=64, R=128); ``sink_tokens`` are kept there at full precision.
    ``sample_drafts=False`` drafts the view's argmax under sampling too (verified as point masses; still exact).
    """

    shares_target_cache = True

    def __init__(self, view: str = "streaming", sink_tokens: int = 4, window: int = 256,
                 num_draft_tokens: int | str = 4, max_draft_tokens: int = 16, sample_drafts: bool = True,
                 bits: int | None = None, group_size: int | None = None, residual_length: int | None = None):
        super().__init__(num_draft_tokens, max_draft_tokens)
        if view not in VIEWS:
            raise ValueError(f"view={view!r} is unknown; use one of {VIEWS}.")
        for name, value, minimum in (("sink_tokens", sink_tokens, 0), ("window", window, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
        self.view, self.sink_tokens, self.window = view, sink_tokens, window
        self.call_attention = "kvspec_quant" if view == "quantized" else None  # the loop switches for the call
        self.sample_drafts = sample_drafts
        self.max_draft_tokens = max_draft_tokens if num_draft_tokens == "auto" else max(num_draft_tokens, 1)
        self.quant = dict(bits=bits, group_size=group_size, residual_length=residual_length)
        self.model = None
        self.shadow = None  # view="quantized": QuantizedKVCache of the committed columns
        self.last_view_bytes = self.last_view_tokens = 0
        self.touches = 1  # K/V touches per target step (view_costs.touches_per_step), set by check_target

    def check_target(self, target, cache) -> None:
        """Before the first forward: the view reads the target's cache by column (streaming), or keeps codes beside
        a full-precision cache through the fused attention (quantized)."""
        self.touches = touches_per_step(cache)
        if self.view == "streaming":
            check_readable(cache)
            return
        from hf_kvspec.cache.quantized import QuantizedKVCache

        if isinstance(cache, QuantizedKVCache):
            raise ValueError(_QUANTIZED_TARGET)
        self._check_fused_attention(target)

    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        self.model = target
        self.shadow = None
        if self.view == "quantized":
            self._check_fused_attention(target)
        if self.auto is not None:  # the byte model's draft cost and first K until rounds are timed (view_costs.py)
            self.auto.set_priors(self.read_bytes(buffer.tokens.shape[0], buffer.width - 1).draft_ratio,
                                 PRIOR_ACCEPTANCE[self.view])

    def read_bytes(self, batch: int, context: int) -> ViewBytes:
        """Bytes a target step and a draft step read at ``batch`` rows x ``context`` cached columns (fp K/V in the
        target's dtype; the quantized view at its code width)."""
        config, dtype = self.model.config, self.model.dtype
        weights = model_weight_bytes(self.model)
        if self.view == "streaming":
            return view_bytes(config, weights, batch, context, self.sink_tokens + self.window, dtype, self.touches)
        from hf_kvspec.memory import kv_cache_bytes, quantized_view_bytes

        quant = {k: v for k, v in self.quant.items() if v is not None}
        codes = quantized_view_bytes(config, context, batch, dtype, sink_tokens=self.sink_tokens, **quant)
        full = kv_cache_bytes(config, context, batch, dtype)
        return ViewBytes(weights, full, codes, self.touches)

    def propose(self, ctx: DraftContext) -> DraftProposal:
        cache, buffer = ctx.target_cache, ctx.buffer
        committed = buffer.width - 1
        if self.view == "streaming":
            view = StreamingView(cache, buffer.mask[:, :committed], self.sink_tokens, self.window)
            return self._draft(ctx, view, lambda step: view.attention_mask(1, self.model.dtype))
        shadow = self._sync_shadow(cache, committed, buffer.tokens.shape[0])
        proposal = self._draft(ctx, shadow, lambda step: buffer.attention_mask(step + 1))
        shadow.crop(-proposal.draft_forwards)  # the draft's own K/V leave the shadow's full-precision window
        return proposal

    def _draft(self, ctx: DraftContext, cache, mask_for) -> DraftProposal:
        """K draft tokens [B, K]: the root, then each draft but the last, fed one at a time through ``cache``."""
        buffer, count = ctx.buffer, ctx.num_draft_tokens
        ids, positions = buffer.tokens[:, -1:], buffer.positions[:, -1:]  # [B, 1] each
        chain = ChainDraft(ctx, ids[:, :0], sample=self.sample_drafts)
        for step in range(count):
            logits = self.model(input_ids=ids, attention_mask=mask_for(step), position_ids=positions, cache=cache,
                                use_cache=True, logits_to_keep=1).logits  # [B, 1, V]
            ids, positions = chain.next(logits)[:, None], positions + 1
        return chain.proposal()

    # ------------------------------------------------------------------------------------------ quantized shadow
    def _sync_shadow(self, cache, committed: int, batch: int):
        """The shadow holding codes of the target's ``committed`` columns: new columns are copied from ``cache``."""
        from hf_kvspec.cache.quantized import QuantizedKVCache

        if isinstance(cache, QuantizedKVCache):
            raise ValueError(_QUANTIZED_TARGET)
        if self.shadow is None:
            self.shadow = QuantizedKVCache(self.model.config, sink_tokens=self.sink_tokens, **self.quant)
            self.shadow.check_keep_capacity(self.max_draft_tokens)  # drafts must crop out of the window exactly
        held = self.shadow.get_seq_length()
        if held < committed:
            columns = torch.arange(held, committed).expand(batch, -1)
            for i in range(len(cache.layers)):
                keys, values = read_columns(cache, i, columns.to(_device(cache, i)))  # [B, H, n, D]
                self.shadow.update(keys, values, i, kwargs={})  # fused-read path: returns the window, no dequant
        return self.shadow

    @staticmethod
    def _check_fused_attention(model) -> None:
        from hf_kvspec import _compat
        from hf_kvspec.attention.quantized import ATTN_NAME

        if _compat.attn_implementation(model.config) != ATTN_NAME:
            raise ValueError(f"SparseKVAssistant(view='quantized') drafts through the fused {ATTN_NAME} attention, "
                             f"which reads the codes; the target runs "
                             f"{_compat.attn_implementation(model.config)!r}. Leave generate's call_attention "
                             "unset (the call then switches to it and back), or call "
                             "hf_kvspec.enable_quantized_attention(model) first (over any other cache it is SDPA "
                             "reading grouped K/V once, so verification is unchanged).")

    def release(self, rows: list[int]) -> None:
        index = self.staying(rows)
        if self.shadow is not None and self.shadow.get_seq_length() > 0:
            self.shadow.batch_select_indices(index)

    def view_bytes(self) -> int:
        """Bytes the drafter holds beside the target's cache (the quantized shadow, now or at the end of the last
        call; a streaming view lives for one round, see ``hf_kvspec.memory.sparse_view_bytes``)."""
        return self.shadow.nbytes() if self.shadow is not None else self.last_view_bytes

    def end(self) -> None:
        if self.shadow is not None:
            self.last_view_bytes, self.last_view_tokens = self.shadow.nbytes(), self.shadow.get_seq_length()
        self.shadow = None


def _device(cache, layer_idx: int) -> torch.device:
    layer = cache.layers[layer_idx]
    return layer.keys.device if getattr(layer, "is_initialized", False) else torch.device("cpu")
