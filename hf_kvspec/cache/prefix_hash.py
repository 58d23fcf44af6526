"""Chained SHA-256 block hashes for prefix caching (vLLM, Kwon et al. SOSP'23, arXiv 2309.06180).

Boundary: pure functions from token ids to block hashes; no pool, no tensors.

A full block's hash commits to everything that determines its K/V: the hash of the block before it
(so equal hashes imply equal prefixes, not just equal blocks), the block's token ids, and "extra keys"
(here: which columns are left padding, since padding shifts every later position id). An optional
per-tenant ``salt`` seeds the chain's root hash, so identical prompts under
different salts never share blocks — prefix contents are secret across users, and with an unsalted
cache a timing side channel reveals whether someone else sent the same prefix.

Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT = hashlib.sha256(b"hf_kvspec/prefix-cache/v1").digest()


def root_hash(salt: str | None = None) -> bytes:
    """Parent hash of a chain's first block; a distinct root per salt keeps tenants apart."""
    if salt is None:
        return _ROOT
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string or None, got {salt!r}.")
    return hashlib.sha256(_ROOT + b"salt:" + salt.encode("utf-8")).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """SHA-256 of (parent hash, token ids as int64, extra keys) — 32 bytes."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode("utf-8"))
    return digest.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    padding: Sequence[bool] | None = None,
    salt: str | None = None,
    start: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    Args:
        token_ids: one row's token ids, position 0 first.
        block_size: tokens per block.
        padding: per-token flag, True where the column is (left) padding; hashed as an extra key.
        salt: per-tenant cache salt (ignored when ``parent`` is given: it is already in the chain).
        start: first block to hash (blocks before it are already hashed).
        parent: hash of block ``start - 1``; required when ``start > 0``.
    """
    if start > 0 and parent is None:
        raise ValueError("block_hashes(start > 0) needs the parent hash of block start - 1.")
    parent = root_hash(salt) if parent is None else parent
    hashes = []
    for block in range(start, len(token_ids) // block_size):
        lo, hi = block * block_size, (block + 1) * block_size
        pad_columns = tuple(i for i in range(lo, hi) if padding is not None and padding[i])
        extra = ("pad", pad_columns) if pad_columns else ()
        parent = hash_block(parent, token_ids[lo:hi], extra)
        hashes.append(parent)
    return hashes
