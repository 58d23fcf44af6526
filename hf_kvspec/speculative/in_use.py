"""One assistant, one ``generate`` call at a time.

Boundary: a process-wide record, under a lock, of the assistants that running speculative calls hold (by identity);
nothing else. An assistant keeps per-call state (a draft cache, the target's features, row indices) from ``begin``
to ``end``, so a second call with the same instance while the first runs (another thread, a server's concurrent
request, a streamer that calls ``generate`` again) would interleave two calls' state: it is refused, naming the fix.
Different assistant instances over the same target or the same head run concurrently.
"""

from __future__ import annotations

import contextlib
import threading

_lock = threading.Lock()
_running: set[int] = set()  # id() of the assistants a call holds; an id is released before its object can die


@contextlib.contextmanager
def exclusive_use(assistant):
    """Hold ``assistant`` for one call; ``RuntimeError`` if another call holds it now."""
    key = id(assistant)
    with _lock:
        if key in _running:
            raise RuntimeError(f"this {type(assistant).__name__} is in use by another generate call that is still "
                               "running (another thread or request): an assistant keeps per-call state (draft "
                               "caches, features). Build one assistant per concurrent call, e.g. one per thread.")
        _running.add(key)
    try:
        yield
    finally:
        with _lock:
            _running.discard(key)
