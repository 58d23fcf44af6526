"""Attention functions of hf_kvspec and their registration with transformers; public names are re-exported from
hf_kvspec.

Boundary: attention math and the reversible patches that install it (``patch.py``); no cache state. The mask rules
every function follows are ``masks.py``; what a cache hands an attention function comes through
``hf_kvspec.cache.channel``.
"""
