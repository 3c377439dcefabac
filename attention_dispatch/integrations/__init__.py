"""Integrations with the libraries users' models run on.

Each submodule imports its library when it is imported itself, never before:
``attention_dispatch.integrations.transformers`` needs ``pip install 'attention_dispatch[transformers]'``.
``ad.patch_sdpa()`` (any model calling ``F.scaled_dot_product_attention``) lives in ``attention_dispatch.patch``.
"""
