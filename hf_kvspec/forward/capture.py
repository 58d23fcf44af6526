"""Capturing a target's hidden states during its own forward, with forward hooks on the modules that produce them.

Boundary: which target modules produce the features (``feature_module``) and collecting their outputs during one
forward of the model's own modules (``FeatureCapture``); the fast forward returns the same features itself
(``program.forward(feature_layers=...)``). Knows nothing about drafting. Hooks are torch's public
``register_forward_hook`` seam and are removed when the ``with`` block ends, whatever happens inside it.

Why hooks: ``output_hidden_states=True`` keeps every layer's output of the forward; an EAGLE-3 head reads three
layers and Medusa/EAGLE-1 one, so only those are kept.

Layer indices follow transformers' ``output_hidden_states`` tuple of a decoder-only model with ``L`` layers:
``0`` = embedding output, ``i`` in ``1..L-1`` = output of decoder layer ``i - 1``, ``L`` or ``-1`` = the final
norm's output (the last layer's output after the model's norm, what the LM head reads).

Shapes: ``B`` rows, ``T`` fed tokens, ``H`` hidden size, ``F = len(feature_layers) * H``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn


def feature_module(model: nn.Module, index: int) -> nn.Module:
    """The module whose output is ``hidden_states[index]`` of ``model``'s forward."""
    decoder = model.get_decoder()
    layers = decoder.layers
    count = len(layers)
    if not -(count + 1) <= index <= count:
        raise ValueError(f"feature layer {index} is out of range for a model with {count} layers "
                         f"(valid: 0..{count} or -1..-{count + 1}).")
    index = index % (count + 1)
    if index == 0:
        return model.get_input_embeddings()
    return decoder.norm if index == count else layers[index - 1]


class FeatureCapture:
    """``with FeatureCapture(target, [-1]) as capture: target(...)`` then ``capture.features()`` -> [B, T, F].

    Each hooked module keeps the output of its latest call; ``features()`` concatenates them in the order of
    ``feature_layers``. Scoped to the thread that entered the block: the hooks sit on modules every caller of the
    model shares, so a forward of the same model in another thread (another ``generate``, a server's request) is
    not recorded.
    """

    def __init__(self, model: nn.Module, feature_layers: Sequence[int]):
        self.modules = [feature_module(model, i) for i in feature_layers]
        self.outputs: list[torch.Tensor | None] = [None] * len(self.modules)
        self.handles: list = []
        self.thread: int | None = None  # the thread whose forwards are recorded

    def __enter__(self) -> FeatureCapture:
        self.outputs = [None] * len(self.modules)
        self.thread = threading.get_ident()
        try:
            for slot, module in enumerate(self.modules):
                self.handles.append(module.register_forward_hook(self._recorder(slot)))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _recorder(self, slot: int):
        def record(module, args, output):
            if threading.get_ident() == self.thread:  # another thread's forward of the shared module is not ours
                self.outputs[slot] = output[0] if isinstance(output, tuple) else output  # [B, T, H]
        return record

    def features(self) -> torch.Tensor:
        """``[B, T, F]`` of the latest forward."""
        if any(out is None for out in self.outputs):
            raise RuntimeError("FeatureCapture saw no forward pass; call the target inside the `with` block.")
        return torch.cat(self.outputs, dim=-1)
