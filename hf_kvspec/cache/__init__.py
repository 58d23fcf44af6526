"""KV caches of hf_kvspec, and the one contract every cache here obeys.

Boundary: storage of keys/values and the bookkeeping that rolls it back. Attention math lives in
``hf_kvspec.attention`` (``paged.py`` for the pages, ``quantized.py`` for the codes), which never imports this
package; which tokens to keep is decided by the speculative loop. Public names are re-exported from ``hf_kvspec``.

The cache contract
==================
Every cache we ship (``PagedCache``, ``QuantizedKVCache``) is a transformers ``Cache`` of ``CacheLayerMixin``
layers with ``DynamicCache`` semantics, plus the operations below. ``contract.py`` offers the same operations as
functions over *any* cache, so callers never branch on the type: ours forward to the methods, transformers'
``DynamicCache`` / ``StaticCache`` are edited through their public ``layers[i].keys`` / ``.values`` tensors.

C1  **Append.** ``update(keys, values, layer_idx, kwargs=...)`` appends ``[B, Hkv, T, D]`` at the end of layer
    ``layer_idx`` and returns what that layer's attention reads. All rows of a layer share one length
    (transformers batches are rectangular); rows that hold fewer real tokens carry masked holes.
C2  **Per-layer lengths.** Each layer has its own length, ``get_seq_length(layer_idx)``; layers may differ
    (self-speculation appends draft tokens to layers ``0..E-1`` only). Nothing infers "the first layer of a
    forward" from equal lengths.
C3  **Roll back.** ``crop(-k)`` removes the newest ``k`` tokens of every layer (each from its own length; a
    positive argument is refused, as in ``DynamicCache``). ``crop_layers(length, layers=None)`` keeps the first
    ``length`` tokens of the given layers (all by default) only.
C4  **Keep positions.** ``keep_positions(start, indices, layers=None)``: ``indices`` ``[B, k]`` (int64, ascending
    per row, each in ``0..n-1`` for a newest segment of ``n = get_seq_length(layer) - start`` tokens) moves, in
    every row, position ``start + indices[b, j]`` to ``start + j`` and drops the rest of the segment: afterwards
    each layer holds ``start + k`` tokens. Rows that keep fewer than ``k`` tokens repeat an index (any valid one);
    the caller masks those holes, as the chain loop does. Shared storage is never written (paged: copy-on-write).
C5  **Batch edits.** ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``, ``reset``.
C6  **Refuse early.** An operation a cache cannot perform raises ``ValueError`` naming the rule and the fix before
    anything changes (e.g. KIVI's ``QuantizedKVCache.keep_positions`` on a segment already flushed into codes). Bad
    arguments get the same words from every cache: the checks are written once, in ``contract.py``
    (``layer_ids``, ``check_crop_length``, ``check_keep_args``, ``check_crop_arg``). What a cache can do is asked
    once, up front: ``contract.check_contract(cache, keep_positions=..., per_layer=..., segment=...)``, which reads
    class flags (``contract.Capabilities``: ``keeps_positions``, ``crops_layers``, ``has_keep_capacity``) on
    our caches and, for transformers' caches, the one table of layer classes it edits (in ``_compat``).

Where each operation lives:

    op  PagedCache (paged.py)         QuantizedKVCache (quantized.py)     DynamicCache / StaticCache
    C1  update                        QuantizedKVLayer.update             transformers
    C2  get_seq_length(i)             QuantizedKVLayer.get_seq_length     transformers (per layer)
    C3  crop, crop_layers             QuantizedKVLayer.crop, crop_layers  contract.crop_layers
    C4  keep_positions                keep_positions                      contract.keep_positions
    C5  reorder_cache, batch_*, reset QuantizedKVLayer (per layer)        transformers

The one side channel (``hf_kvspec.stored_kv``): when a cache is built for a model whose attention implementation
is one of ours that reads its stored form (``kvspec_paged`` reads pages through block tables, ``kvspec_quant``
reads codes), the cache layer hands a ``StoredKV`` object to it through the kwargs transformers passes from
``cache.update`` to the attention function — one key, one owner (the cache layer writes it, our attention
functions read it). Built under any other attention implementation, ``update`` returns dense ``[B, Hkv, S, D]``
keys/values that any attention reads. The pairing is fixed at construction (``cache.paired_attention``): switching
the model's attention later never changes what ``update`` returns (a paired cache refuses a forward its reader
does not run).
"""
