"""Attention functions of hf_kvspec and their registration with transformers; public names are re-exported from
hf_kvspec.

Boundary: attention math and the reversible patches that install it (``patch.py``); no cache state, and no import
of ``hf_kvspec.cache``. The mask rules every function follows are ``masks.py``; what a cache hands an attention
function (pages for ``paged.py``, codes for ``quantized.py``) comes through ``hf_kvspec.stored_kv``.
"""
