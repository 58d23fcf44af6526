"""Self-speculation on the target's own cache: EarlyExitAssistant and LayerSkipAssistant.

References: plain ``generate`` (greedy token identity), a plain forward over the accepted tokens (the shared cache
after every round), exact marginals by enumeration (sampling), a snapshot of the model (exceptions).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvspec.speculative.drafters.early_exit import EarlyExitAssistant
from hf_kvspec.speculative.drafters.layer_skip import LayerSkipAssistant
from hf_kvspec.speculative.loop import speculative_generate
from hf_kvspec.speculative.partial_forward import PartialForward
from tests.speculative.helpers import batch
from tests.tiny_models import tiny_model

LAYERS = 4


def _model(kind: str, **overrides):
    return tiny_model(kind, num_hidden_layers=LAYERS, **overrides)


def _spec(model, assistant, ids, mask, max_new_tokens=16, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, custom_generate=speculative_generate,
                          assistant=assistant, return_dict_in_generate=True, **kwargs)


ASSISTANTS = {
    "early_exit_1": lambda: EarlyExitAssistant(1, num_draft_tokens=3),
    "early_exit_2": lambda: EarlyExitAssistant(2, num_draft_tokens=4),
    "early_exit_auto": lambda: EarlyExitAssistant(3, num_draft_tokens="auto"),
    "layer_skip_1": lambda: LayerSkipAssistant([1], num_draft_tokens=3),
    "layer_skip_0_3": lambda: LayerSkipAssistant([0, 3], num_draft_tokens=2),
    "layer_skip_search": lambda: LayerSkipAssistant("search", num_draft_tokens=3, calibration_tokens=8),
}


def test_partial_forward_equals_the_model_forward():
    """All layers through PartialForward (the plumbing) == the model's own forward: logits and every cache layer."""
    model = _model("llama")
    ids, mask = batch(3)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=DynamicCache(config=model.config),
                use_cache=True)
    stack, cache = PartialForward(model), DynamicCache(config=model.config)
    with torch.no_grad():
        logits = stack.logits(stack.run(stack.embed(ids), range(LAYERS), mask, positions, cache))
    real = mask.bool()
    # fp32, same kernels, a 4D mask instead of transformers' own: equal to rounding
    torch.testing.assert_close(logits[real], out.logits[real], atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(cache.layers, out.cache.layers):
        torch.testing.assert_close(ours.keys.transpose(1, 2)[real], theirs.keys.transpose(1, 2)[real], atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(ours.values.transpose(1, 2)[real], theirs.values.transpose(1, 2)[real],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(ASSISTANTS))
@pytest.mark.parametrize("size", [1, 3])
def test_greedy_token_identity(kind, name, size):
    model = _model(kind)
    ids, mask = batch(size)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = _spec(model, ASSISTANTS[name](), ids, mask, do_sample=False)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.draft_forwards > 0  # it did draft


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_exit_at_the_last_layer_accepts_every_draft(kind):
    model = _model(kind)
    ids, mask = batch(3)
    out = _spec(model, EarlyExitAssistant(LAYERS, num_draft_tokens=3), ids, mask, max_new_tokens=17, do_sample=False)
    assert out.acceptance.acceptance_rate == [1.0, 1.0, 1.0]
    assert torch.equal(out.sequences, model.generate(ids, attention_mask=mask, max_new_tokens=17, do_sample=False))


class _Recorder(EarlyExitAssistant):
    """Snapshots the shared cache and the buffer after each round's roll back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.snapshots = []

    def propose(self, ctx):
        self.buffer = ctx.buffer
        self.cache = ctx.target_cache
        return super().propose(ctx)

    def observe(self, outcome):
        super().observe(outcome)
        width = outcome.kept_width
        buf = self.buffer
        self.snapshots.append((buf.tokens[:, :width].clone(), buf.mask[:, :width].clone(),
                               buf.positions[:, :width].clone(),
                               [(layer.keys.clone(), layer.values.clone()) for layer in self.cache.layers]))


@pytest.mark.parametrize("exit_layer", [1, 3])
def test_shared_cache_after_each_round_equals_a_plain_forward_over_the_accepted_tokens(exit_layer):
    model = _model("llama")
    ids, mask = batch(3)
    assistant = _Recorder(exit_layer, num_draft_tokens=3)
    _spec(model, assistant, ids, mask, do_sample=False)
    assert len(assistant.snapshots) > 3
    for tokens, keep, positions, layers in assistant.snapshots:
        reference = model(input_ids=tokens, attention_mask=keep, position_ids=positions,
                          cache=DynamicCache(config=model.config), use_cache=True).cache
        real = keep.bool()  # holes and padding hold whatever was written; no query ever reads them
        for i, (keys, values) in enumerate(layers):
            assert keys.shape == reference.layers[i].keys.shape, f"layer {i} length"
            # the rounds fed columns in other block sizes than one forward: fp32 rounding only
            torch.testing.assert_close(keys.transpose(1, 2)[real], reference.layers[i].keys.transpose(1, 2)[real],
                                       atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(values.transpose(1, 2)[real],
                                       reference.layers[i].values.transpose(1, 2)[real], atol=1e-5, rtol=1e-4)


def _count_positions(model):
    """Forward pre-hooks on every decoder layer: the position ids each call processed, per layer."""
    seen = {i: [] for i in range(LAYERS)}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, kwargs, i=i):
            seen[i].extend(kwargs["position_ids"][0].tolist())
        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_no_layer_processes_a_drafted_position_again(exit_layer):
    """bs 1: every layer (0..E-1 included) processes exactly the columns a plain verify forward would: the prompt
    once, then N + 1 columns per round; a drafted position is never fed to layers 0..E-1 a second time."""
    model = _model("llama")
    ids, mask = batch(1)
    seen, handles = _count_positions(model)
    try:
        out = _spec(model, EarlyExitAssistant(exit_layer, num_draft_tokens=3), ids, mask, do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    stats = out.acceptance
    for i in range(LAYERS):
        assert sorted(seen[i]) == sorted(seen[LAYERS - 1]), f"layer {i} did other work than the last layer"
    # the prefill feeds the prompt (P columns); every round N + 1 columns per layer (N drafted, then 1 in verify)
    assert len(seen[0]) == ids.shape[1] + stats.rounds + stats.draft_forwards


def _snapshot(model):
    probe = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    return ({k: v.clone() for k, v in model.state_dict().items()}, model.config.to_dict(),
            [(name, type(m).__name__) for name, m in model.named_modules()], logits)


def _assert_unchanged(model, before):
    after = _snapshot(model)
    assert before[0].keys() == after[0].keys()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1] == after[1] and before[2] == after[2]
    assert torch.equal(before[3], after[3])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["draft", "verify"])
@pytest.mark.parametrize("make", [lambda: EarlyExitAssistant(2, num_draft_tokens=3),
                                  lambda: LayerSkipAssistant([1], num_draft_tokens=3)])
def test_model_unchanged_after_an_exception(where, make):
    model = _model("llama")
    before = _snapshot(model)
    assistant = make()
    calls = {"n": 0}
    original = assistant.propose

    def propose(ctx):  # let the first rounds pass, then raise inside the second draft / verify
        calls["n"] += 1
        if calls["n"] == 3:
            layer = model.model.layers[0 if where == "draft" else LAYERS - 1]
            handle = layer.register_forward_hook(lambda *a: (_ for _ in ()).throw(_Boom()))
            try:
                if where == "draft":
                    return original(ctx)
                assistant._handle = handle
                return original(ctx)
            finally:
                if where == "draft":
                    handle.remove()
        return original(ctx)

    assistant.propose = propose
    ids, mask = batch(2)
    cache = DynamicCache(config=model.config)
    with pytest.raises(_Boom):
        _spec(model, assistant, ids, mask, do_sample=False, cache=cache)
    if where == "verify":
        assistant._handle.remove()
    _assert_unchanged(model, before)
    if where == "draft" or isinstance(assistant, EarlyExitAssistant):  # the drafter's own writes are rolled back
        assert len({int(cache.get_seq_length(i)) for i in range(LAYERS)}) == 1


@pytest.mark.parametrize("make", [lambda: EarlyExitAssistant(1, num_draft_tokens=2),
                                  lambda: LayerSkipAssistant([0], num_draft_tokens=2)])
def test_sampling_matches_plain_sampling(make):
    """The 2nd and 3rd generated tokens (the first drafted ones) have the target's exact marginals: 60k rows of one
    prompt against the marginals enumerated from the model. Expected TV of 60k samples over 8 outcomes is about
    0.5 * sqrt(8) * sqrt(2 / (pi * 60000)) ~ 0.005; a drafter sampled without correction is off by far more."""
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=2, vocab_size=8, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                       eos_token_id=None)
    with torch.no_grad():  # sharpen the random model a little so drafts and target differ visibly
        model.lm_head.weight.mul_(8)
    prompt = torch.tensor([[3, 4, 5]])
    rows = 60_000
    ids = prompt.expand(rows, -1)
    out = _spec(model, make(), ids, torch.ones_like(ids), max_new_tokens=3, do_sample=True, top_k=0)
    new = out.sequences[:, 3:]
    exact = _exact_marginals(model, prompt, steps=3)
    for step in (1, 2):
        empirical = torch.bincount(new[:, step], minlength=8).double() / rows
        tv = 0.5 * (empirical - exact[step]).abs().sum()
        assert tv < 0.01, (step, float(tv))


def _exact_marginals(model, prompt, steps):
    """Marginal distribution [V] of each generated token, by enumerating every path (V ** (steps - 1) forwards)."""
    vocab = model.config.vocab_size
    paths = {(): 1.0}
    marginals = []
    for _ in range(steps):
        marginal = torch.zeros(vocab, dtype=torch.float64)
        following = {}
        for path, weight in paths.items():
            ids = torch.cat([prompt, torch.tensor([path], dtype=torch.long).reshape(1, -1)], dim=1)
            with torch.no_grad():
                probs = torch.softmax(model(input_ids=ids).logits[0, -1].double(), dim=-1)
            marginal += weight * probs
            for token in range(vocab):
                following[(*path, token)] = weight * float(probs[token])
        marginals.append(marginal)
        paths = following
    return marginals


def test_unsupported_architecture_is_refused_by_name():
    model = tiny_model("mistral", num_hidden_layers=2)  # sliding_window=8 in the tiny config
    ids, mask = batch(1)
    with pytest.raises(NotImplementedError, match="sliding"):
        _spec(model, EarlyExitAssistant(1), ids, mask, do_sample=False)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="exit_layer"):
        EarlyExitAssistant(0)
    with pytest.raises(ValueError, match="skip_layers"):
        LayerSkipAssistant("all")
    model = _model("llama")
    ids, mask = batch(1)
    with pytest.raises(ValueError, match="exit_layer=9"):
        _spec(model, EarlyExitAssistant(9), ids, mask, do_sample=False)


def test_search_logs_its_steps_and_keeps_a_layer():
    model = _model("llama")
    assistant = LayerSkipAssistant("search", num_draft_tokens=3, calibration_tokens=8)
    ids, mask = batch(1)
    _spec(model, assistant, ids, mask, do_sample=False)
    assert len(assistant.search_log) == LAYERS // 2
    assert [len(skip) for skip, _, _ in assistant.search_log] == list(range(1, LAYERS // 2 + 1))
    assert len(assistant.skip_layers) < LAYERS


def test_assistant_specs():
    from hf_kvspec.speculative.assistants import check_spec, make_assistant

    assert check_spec("early_exit:3") == ("early_exit", 3)
    assert check_spec("early_exit") == ("early_exit", None)
    assert check_spec("layer_skip") == ("layer_skip", None)
    for bad in ("early_exit:", "early_exit:0", "early_exit:x"):
        with pytest.raises(ValueError, match="early_exit"):
            check_spec(bad)
    model = _model("llama")
    default = make_assistant("early_exit", model, num_draft_tokens=3)
    assert isinstance(default, EarlyExitAssistant) and default.exit_layer == LAYERS // 2
    assert make_assistant("early_exit:3", model).exit_layer == 3
    skipping = make_assistant("layer_skip", model, num_draft_tokens="auto")
    assert isinstance(skipping, LayerSkipAssistant) and skipping.skip_layers == "search"
