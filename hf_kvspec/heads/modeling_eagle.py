"""EAGLE drafter (Li et al., arXiv 2401.15077; EAGLE-3, arXiv 2503.01840) as a ``PreTrainedModel``.

Boundary: one draft step maps (next token, target feature) pairs to a draft hidden state and next-token logits, and
``unrolled`` runs several steps with the EAGLE-3 "training-time test" mask. Drafting trees and verification live in
``hf_kvspec.speculative``; training in ``scripts/train_drafter.py``.

Shapes: B batch, T positions, H hidden size, F = len(feature_layers) * H raw feature width, V vocabulary,
J unrolled steps.

Alignment (EAGLE's shifted pairing): row t pairs the target feature ``f_t`` (base hidden state after token x_t) with
the embedding of ``x_{t+1}``; the draft hidden state ``g_t`` predicts ``f_{t+1}`` and its logits predict ``x_{t+2}``.

Deviations: the decoder layer is the base architecture's own class built from its config (not a copy); a final
RMSNorm sits before the borrowed LM head (as in EAGLE-3); with one feature layer the feature is the base model's
*normalised* last hidden state (what its LM head sees).

Two layer layouts (``config.architecture``): ``"eagle1"`` (ours since the first heads) feeds
``fc(embed ⊕ fused)`` [B, T, H] through the stock layer; ``"eagle3"`` is the paper's layer, the one vLLM
``speculators`` (``Eagle3DraftModel``) and SGLang (``LlamaForCausalLMEagle3``) serve: the layer's q/k/v projections
read ``input_layernorm(embed) ⊕ hidden_norm(fused)`` [B, T, 2H] and the residual is the fused hidden itself.
With ``config.draft_vocab_size = N`` the head projects onto its own ``lm_head`` [N, H] and ``draft_to_target``
maps draft ids back (``d2t``/``t2d`` buffers, ``modeling_common``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, DynamicCache, PreTrainedConfig
from transformers.utils import ModelOutput

from hf_kvspec import _compat
from hf_kvspec.heads.configuration import EagleConfig
from hf_kvspec.heads.modeling_common import DraftHeadModel
from hf_kvspec.masking import additive_mask


@dataclass
class EagleOutput(ModelOutput):
    """hidden_states: [B, T, H] draft hidden state g (before the norm); logits: [B, T, V] or None; cache."""

    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: DynamicCache | None = None


def layer_config(config: EagleConfig, attn_implementation: str = "sdpa") -> PreTrainedConfig:
    """The base architecture's config for the drafter's single decoder layer (layer index 0)."""
    if config.base_config is None:
        raise ValueError("EagleConfig.base_config is empty; build the config with EagleConfig.for_base_model(model).")
    fields = {k: v for k, v in config.base_config.items() if k not in ("architectures", "auto_map")}
    fields["num_hidden_layers"] = 1
    if isinstance(fields.get("layer_types"), list):  # per-layer attention kinds: keep the first layer's
        fields["layer_types"] = fields["layer_types"][:1]
    return AutoConfig.for_model(fields.pop("model_type"), attn_implementation=attn_implementation, **fields)


def unrolled_step_mask(valid: torch.Tensor, step: int) -> torch.Tensor:
    """Bool mask [B, 1, T, (step+1)*T] (True = attend) for step ``step`` of the training-time test (EAGLE-3).

    Query (step j, start s) sits at position s+j and may see: step-0 keys at columns c <= s (true features of the
    verified prefix, padding excluded), and for each earlier unrolled step i in 1..j only the key of its own start s
    (the chain it drafted itself). Worked example, T=3, j=1 (columns: step 0 | step 1):
        s=0: 1 0 0 | 1 0 0
        s=1: 1 1 0 | 0 1 0
        s=2: 1 1 1 | 0 0 1
    valid: [B, T] bool, True on real tokens.
    """
    size = valid.shape[1]
    prefix = torch.ones(size, size, dtype=torch.bool, device=valid.device).tril()   # [T, T], c <= s
    own = torch.eye(size, dtype=torch.bool, device=valid.device)                     # [T, T], c == s
    allowed = torch.cat([prefix] + [own] * step, dim=1)                              # [T, (j+1)T]
    keys_valid = torch.cat([valid] + [torch.ones_like(valid)] * step, dim=1)         # [B, (j+1)T]
    return (allowed[None] & keys_valid[:, None, :])[:, None]                         # [B, 1, T, (j+1)T]


def widen_attention_inputs(layer: nn.Module, config: PreTrainedConfig) -> nn.Module:
    """EAGLE-3: give the layer's q/k/v projections 2H inputs (embedding ⊕ hidden); returns the new ``hidden_norm``.

    The layer is built here, by the drafter, so replacing its projections is construction, not patching."""
    attention, hidden = layer.self_attn, config.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attention, name, None)
        if old is None or not hasattr(layer, "input_layernorm") or not hasattr(layer, "mlp"):
            raise ValueError(f"architecture='eagle3' needs a Llama-style decoder layer (self_attn.q/k/v_proj, "
                             f"input_layernorm, mlp); {type(layer).__name__} differs: use architecture='eagle1'.")
        setattr(attention, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
    return nn.RMSNorm(hidden, eps=getattr(config, "rms_norm_eps", 1e-6))


class EagleHead(DraftHeadModel):
    """One base-architecture decoder layer over ``fc(concat(embed(token), feature))``; borrowed embedding + LM head.

    Example (one draft step after a target forward)::

        drafter = EagleHead.from_pretrained(path).attach(base_model)
        out = base_model(ids, output_hidden_states=True)
        features = drafter.collect_features(out.hidden_states)                 # [B, T, F]
        next_ids = torch.cat([ids[:, 1:], out.logits[:, -1:].argmax(-1)], 1)   # x_{t+1} for every row t
        draft = drafter(next_ids, features=features)                           # .logits [B, T, V] predict x_{t+2}
    """

    config_class = EagleConfig

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        hidden, eagle3 = config.base_hidden_size, config.architecture == "eagle3"
        self.layer_config = layer_config(config)
        self.fuse = (nn.Linear(config.num_feature_layers * hidden, hidden, bias=False)
                     if config.num_feature_layers > 1 else None)
        self.fc = None if eagle3 else nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = _compat.decoder_layer_class(self.layer_config)(self.layer_config, layer_idx=0)
        self.hidden_norm = widen_attention_inputs(self.layer, self.layer_config) if eagle3 else None
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = _compat.rotary_embedding_class(self.layer_config)(config=self.layer_config)
        self.lm_head = (nn.Linear(hidden, config.draft_vocab_size, bias=False)
                        if config.draft_vocab_size is not None else None)
        self._init_draft_vocab(config.draft_vocab_size)
        self.post_init()

    # ---- features -------------------------------------------------------------------------------------------------
    def collect_features(self, base_hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Base model's ``hidden_states`` tuple (each [B, T, H]) -> raw features [B, T, F] for ``feature_layers``."""
        return torch.cat([base_hidden_states[i] for i in self.config.feature_layers], dim=-1)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, F] -> [B, T, H] (identity for a single feature layer)."""
        return features if self.fuse is None else self.fuse(features)

    # ---- one step ---------------------------------------------------------------------------------------------------
    def step(self, input_ids: torch.Tensor, fused: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, cache: DynamicCache | None = None) -> torch.Tensor:
        """input_ids [B, T] (token after each feature's position), fused [B, T, H], position_ids [B, T] -> g [B, T, H].

        ``attention_mask``: additive [B, 1, T, S+T] or None for plain causal attention over ``cache`` + new rows.
        """
        embeds = self.borrowed().embed_tokens(input_ids).to(fused.dtype)                  # [B, T, H]
        if attention_mask is None and input_ids.shape[1] > 1 and cache is not None and cache.get_seq_length() > 0:
            # sdpa's implicit causal mask is top-left aligned: wrong for several new rows after cached ones
            raise ValueError("Pass an explicit attention_mask when adding several rows to a non-empty drafter cache.")
        rope = self.rotary_emb(fused, position_ids=position_ids)
        if self.fc is None:
            return self._eagle3_layer(embeds, fused, rope, attention_mask, cache)
        hidden = self.fc(torch.cat([embeds, fused], dim=-1))                               # [B, T, H]
        return self.layer(hidden, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                          use_cache=cache is not None, position_embeddings=rope)

    def _eagle3_layer(self, embeds: torch.Tensor, fused: torch.Tensor, rope, attention_mask, cache) -> torch.Tensor:
        """EAGLE-3's layer: embeds, fused [B, T, H] -> [B, T, H]; attention over the 2H-wide normalised pair."""
        layer, normed = self.layer, self.hidden_norm(fused)
        residual = normed if self.config.norm_before_residual else fused
        pair = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)                 # [B, T, 2H]
        attended, _ = layer.self_attn(hidden_states=pair, position_embeddings=rope, attention_mask=attention_mask,
                                      cache=cache)
        hidden = residual + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def projection_weight(self) -> torch.Tensor:
        """[N, H] the head's own draft-vocabulary projection, or the borrowed [V, H] LM head."""
        return self.lm_head.weight if self.lm_head is not None else self.borrowed().lm_head.weight

    def logits(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        """g [B, T, H] -> logits [B, T, V] through the norm and the borrowed LM head ([B, T, N] over draft ids
        with a draft vocabulary: map the chosen columns with ``draft_to_target``)."""
        return torch.einsum("bth,vh->btv", self.norm(draft_hidden), self.projection_weight())

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor | None = None,
                draft_hidden: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: DynamicCache | None = None,
                return_logits: bool = True, **kwargs) -> EagleOutput:
        """One draft step. Give ``features`` (raw target features [B, T, F]) or ``draft_hidden`` (the drafter's own
        previous output [B, T, H], used in place of the feature when drafting beyond the verified prefix)."""
        if (features is None) == (draft_hidden is None):
            raise ValueError("Pass exactly one of features= (target) or draft_hidden= (drafter's own output).")
        fused = self.fuse_features(features) if features is not None else draft_hidden
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        hidden = self.step(input_ids, fused, position_ids, attention_mask, cache)
        return EagleOutput(hidden_states=hidden, logits=self.logits(hidden) if return_logits else None, cache=cache)

    # ---- training-time test -----------------------------------------------------------------------------------------
    def unrolled(self, input_ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor,
                 steps: int) -> list[torch.Tensor]:
        """Draft ``steps`` tokens from every start position at once; returns [g_0, ..., g_{J-1}], each [B, T, H].

        input_ids: [B, T] with ``input_ids[:, s] = x_{s+1}``; step j at start s consumes ``x_{s+j+1}`` (the token
        a correct chain would have drafted) and, for j >= 1, its own previous hidden state instead of a feature.
        valid: [B, T] bool. Rows whose shifted token runs past the end reuse the last column (their labels are
        masked by the caller).
        """
        size = input_ids.shape[1]
        positions = torch.arange(size, device=input_ids.device)[None].expand_as(input_ids)
        cache, fused, outputs = DynamicCache(), self.fuse_features(features), []
        for j in range(steps):
            ids_j = input_ids[:, (torch.arange(size, device=input_ids.device) + j).clamp(max=size - 1)]
            mask = additive_mask(unrolled_step_mask(valid, j), fused.dtype)
            hidden = self.step(ids_j, fused if j == 0 else outputs[-1], positions + j, mask, cache)
            outputs.append(hidden)
        return outputs

    @classmethod
    def for_base_model(cls, base_model: nn.Module, name_or_path: str | None = None,
                       feature_layers: list[int] | None = None, **kwargs) -> EagleHead:
        """A freshly initialised drafter for ``base_model`` (config filled from it), already attached."""
        return cls(EagleConfig.for_base_model(base_model, name_or_path, feature_layers=feature_layers,
                                              **kwargs)).attach(base_model)


def __getattr__(name: str):
    if name == "EagleDrafter":  # the model's name before "drafter" was kept for the assistants' side
        import warnings

        warnings.warn("hf_kvspec EagleDrafter is now EagleHead; the old name will be removed", FutureWarning,
                      stacklevel=2)
        return EagleHead
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
