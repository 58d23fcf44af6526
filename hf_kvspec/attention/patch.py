"""The handle every hf_kvspec attention patch returns: ``.remove()`` undoes it, ``with`` scopes it.

Boundary: bookkeeping only. The patch itself (switching an attention implementation, replacing an MLA
module's forward) is done by its own module, which hands this class the closure that undoes it. The shared steps of
the attention implementations (register a forward + mask under a name, undo that, switch a loaded model to it) live
here once, for ``kvspec_gqa``, ``kvspec_paged`` and ``kvspec_quant`` alike.

One rule for every patch: a model holds at most one active patch of each kind (one attention switch:
``enable_gqa``, ``enable_quantized_attention``, ...; one MLA absorption). A second ``enable_*`` of the same kind
while a handle is active is refused with a ``ValueError`` naming that handle (as ``enable_mla_absorb`` refuses
a second absorb), so whatever order handles are removed in, removing them all restores the original.
``switch_attention`` keeps the record of active switches.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

# model -> its active attention switch; weak, so a forgotten model takes its record with it
_active_switches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class AttentionPatch:
    """A reversible change to a loaded model.

    ``remove()`` restores the exact previous state and is idempotent; the handle is also a context
    manager, so ``with hf_kvspec.enable_mla_absorb(model): ...`` patches only inside the block.
    """

    def __init__(self, name: str, undo: Callable[[], None], details: str = ""):
        self.name = name
        self.details = details
        self._undo: Callable[[], None] | None = undo

    @property
    def active(self) -> bool:
        return self._undo is not None

    def remove(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()

    def __enter__(self) -> AttentionPatch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"AttentionPatch({self.name!r}, {state}{', ' + self.details if self.details else ''})"


def register_attention(name: str, forward: Callable, mask: Callable, saved: dict) -> None:
    """Register ``forward`` with ``AttentionInterface`` and ``mask`` with ``AttentionMaskInterface`` under ``name``.

    The mask entry matters: for an unknown name transformers builds no mask and hands the function
    ``attention_mask=None``, silently ignoring padding. What held ``name`` before the first call is kept in
    ``saved`` for ``unregister_attention``. Which stored form (``hf_kvspec.stored_kv``) a function reads is a
    property of the form (``StoredKV.reader``), not of this registration. Idempotent.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from hf_kvspec import _compat

    saved.setdefault(name, _compat.attention_entries(name))
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask)


def unregister_attention(name: str, saved: dict) -> None:
    """Undo ``register_attention``, restoring whatever held ``name`` before. Safe to repeat."""
    from hf_kvspec import _compat

    if name in saved:
        _compat.restore_attention_entries(name, *saved.pop(name))


def switch_attention(model, name: str) -> AttentionPatch:
    """Switch a loaded model to the registered implementation ``name``; ``.remove()`` switches back.

    Refused while another switch of this model is active (see the module docstring).
    """
    from hf_kvspec import _compat

    if not callable(getattr(model, "set_attn_implementation", None)):
        raise TypeError(f"expected a loaded transformers model (a PreTrainedModel), got {type(model).__name__}; "
                        "pass the model itself, not its config or a path.")
    active = _active_switches.get(model)
    if active is not None and active.active:
        raise ValueError(f"{type(model).__name__} is already switched to {active.name!r} by an active handle "
                         f"({active!r}); call .remove() on it (or leave its `with` block) before switching to "
                         f"{name!r}.")
    previous = _compat.attn_implementation(model.config)
    model.set_attn_implementation(name)
    if _compat.attn_implementation(model.config) != name:
        raise ValueError(f"{type(model).__name__} cannot switch attention implementation after loading; load it "
                         f"with attn_implementation={name!r} after hf_kvspec.register().")

    model_ref = weakref.ref(model)  # the record must not keep a forgotten model alive (its key is weak)

    def undo() -> None:
        switched = model_ref()
        if switched is not None:
            _active_switches.pop(switched, None)
            switched.set_attn_implementation(previous)

    patch = AttentionPatch(name, undo, f"previous={previous!r}")
    _active_switches[model] = patch
    return patch



def restore_switched_models(action: str) -> None:
    """Before ``action`` (unregistering the attention functions): switch every model that still runs one back to
    what it ran before, removing its handle (its next forward would otherwise look up a name that is gone), and
    say so in a warning naming the models."""
    import warnings

    active = [(model, patch) for model, patch in list(_active_switches.items()) if patch.active]
    for _, patch in active:
        patch.remove()
    if active:
        names = ", ".join(f"{type(model).__name__} ({patch.name!r} -> {patch.details})" for model, patch in active)
        warnings.warn(f"{action} switched {len(active)} model(s) back from hf_kvspec's attention: {names}; their "
                      "enable_*() handles are removed. Call .remove() on a handle first to choose when.", UserWarning,
                      stacklevel=3)
