"""The handle every hf_kvspec attention patch returns: ``.remove()`` undoes it, ``with`` scopes it.

Boundary: bookkeeping only. The patch itself (switching an attention implementation, replacing an MLA
module's forward) is done by its own module, which hands this class the closure that undoes it.
"""

from __future__ import annotations

from collections.abc import Callable


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
