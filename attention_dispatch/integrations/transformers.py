"""transformers: ``attn_implementation="attention_dispatch"`` runs every attention call of a model through ``ad.sdpa``.

    from attention_dispatch.integrations import transformers as ad_hf
    ad_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attention_dispatch")

``register()`` installs two functions under one name, always together: the attention function
(``AttentionInterface``) and the mask function (``AttentionMaskInterface``). transformers builds
no mask at all for a name without a mask function (``masking_utils._preprocess_mask_arguments``
returns None), so an attention function registered alone would silently ignore padding; the
attention function refuses to run (ValueError) where its name has no mask function.

How a call of the model maps onto ``ad.sdpa`` (transformers' "sdpa" implementation is the reference;
every rule below computes what it computes):

- masks: the mask function is transformers' ``sdpa_mask`` (a bool mask, True = attend, or None
  where ``is_causal`` alone is exact), with one change: a plain causal sliding-window mask is
  skipped under the same conditions as a full causal one, because the window reaches ``ad.sdpa``
  as ``window=`` (transformers materialises it whenever the window is shorter than the keys).
- causal: as "sdpa": the module's ``is_causal`` (or the call's), and only without a mask and with
  more than one query row (``causal="top_left"``; keys past the queries, an empty static cache's
  prefill, are cropped as "sdpa" crops them). One query row attends to every key it is given.
- sliding windows: ``window=(sliding_window - 1, 0)`` (transformers allows key positions
  ``> q - sliding_window``) whenever there is no mask; a mask, where one is needed (padding, a
  static cache, custom patterns), already holds the window, as it does for "sdpa". The layer's
  window comes from the call's ``sliding_window`` argument, else the module's ``sliding_window``
  attribute, else the config (``layer_types`` with ``layer_idx``, or every layer).
- GQA: ``enable_gqa`` whenever the key has fewer heads (no ``repeat_kv``); ``scaling`` is ``scale``;
  ``dropout`` is ``dropout_p`` (transformers passes 0.0 in eval mode).
- position biases (T5): the float bias is ``attn_mask`` (combined with a bool mask as
  "sdpa" does, ``finfo.min`` where masked); its gradient flows.
- padding-free packed batches (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``:
  ``cu_seq_lens_q/k``, ``max_length_q/k``): one varlen call on the packed ``(total, H, D)`` tensors,
  causal per sequence, a window included. Without a cache (``use_cache=False``) transformers also
  derives a block-diagonal (T, T) mask from ``position_ids`` for such a batch, which is then not read;
  with ``position_ids`` alone that mask is what separates the sequences (dense, as for "sdpa").
- logit softcapping (Gemma 2: ``softcap``) is ``softcap=`` (0 or None: none); attention sinks
  (GPT-OSS: ``s_aux``, or ``sinks``) are ``sinks=``, their gradient included.
- sparse indices, paged (continuous-batching) caches: ``ad.sdpa`` has no such arguments, so the call
  raises ``NotImplementedError`` naming the argument and the model, never drops them.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    sdpa_mask,
    sliding_window_overlay,
)

from ..api import sdpa
from ..debug import logger

__all__ = ["register", "attention_forward", "attention_mask", "DEFAULT_NAME"]

DEFAULT_NAME = "attention_dispatch"

_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# keyword arguments some models pass that change the attention's result and have no ad.sdpa argument
_UNSUPPORTED = {
    "indices": "sparse attention indices (indices)",
    "block_indices": "sparse attention blocks (block_indices)",
    "block_table": "a paged KV cache (block_table, continuous batching)",
}
# transformers gives names containing these special treatment (model.get_correct_attn_implementation):
# "sdpa" is refused by models without `_supports_sdpa`, "flash" and "flex_attention" are checked as
# those libraries, "paged|" is a prefix it strips, "owner/repo" is a kernel from the Hub
_RESERVED = ("sdpa", "flash", "flex_attention", "paged|", "/", ":")

# the code objects behind transformers' sliding-window causal mask function: and_masks(overlay, causal)
_AND_CODE = and_masks(causal_mask_function).__code__
_OVERLAY_CODE = sliding_window_overlay(1).__code__

_warned_output_attentions = False


def register(name: str = DEFAULT_NAME) -> str:
    """Register the attention function and its mask function with transformers under ``name``;
    then ``attn_implementation=name`` (``from_config``, ``from_pretrained``,
    ``model.set_attn_implementation``) runs every attention call through ``ad.sdpa``. Returns ``name``.
    Registering again replaces the functions (same name) or adds another name."""
    if not isinstance(name, str) or not name or name == "eager" or any(r in name for r in _RESERVED):
        raise ValueError(
            f"name={name!r}: transformers treats names that contain any of {list(_RESERVED)} (or 'eager') "
            "as its own implementations (models without SDPA support refuse names containing 'sdpa'); "
            f"choose another, e.g. {DEFAULT_NAME!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _plain_sliding_window(mask_function, config, local_size) -> bool:
    """Whether a mask request is transformers' plain causal sliding-window mask of ``config.sliding_window``:
    ``and_masks(sliding_window_overlay(w), causal_mask_function)``, with no padding-free packing, block
    ids or custom ``or``/``and`` functions in it (its creator sets ``allow_is_causal_skip=False`` for
    each of those; the caller checked that it is True) and not a chunked mask (same ``local_size``
    argument)."""
    if local_size is None or getattr(config, "sliding_window", None) != local_size:
        return False
    if getattr(config, "attention_chunk_size", None) == local_size:
        return False
    if getattr(mask_function, "__code__", None) is not _AND_CODE:
        return False
    try:
        parts = _closure(mask_function).get("mask_functions")
    except AttributeError:  # torch.compile does not let closures be read: the evidence above decides
        return True
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return False
    if getattr(parts[0], "__code__", None) is not _OVERLAY_CODE:
        return False
    try:
        return _closure(parts[0]).get("sliding_window") == local_size
    except AttributeError:
        return True


def attention_mask(
    *args, mask_function=causal_mask_function, local_size=None, allow_is_causal_skip: bool = True, **kwargs
):
    """transformers' ``sdpa_mask`` (bool, True = attend; None where ``is_causal`` alone is exact), except
    that a plain causal sliding-window mask may be skipped like a full causal one: the attention
    function then passes the window as ``window=``. Any other pattern (padding, packing, chunks,
    custom ``or``/``and`` functions, bidirectional windows) is materialised exactly as for "sdpa".
    The other arguments pass through unchanged (their names differ between transformers versions)."""
    if allow_is_causal_skip and _plain_sliding_window(mask_function, kwargs.get("config"), local_size):
        local_size = None  # the window alone no longer forces a materialised mask
    return sdpa_mask(
        *args, mask_function=mask_function, local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs
    )


def _model_name(module) -> str:
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    return f"{type(module).__name__} (model_type={model_type!r})" if model_type else type(module).__name__


def _refuse_unsupported(module, kwargs: dict) -> None:
    for arg, what in _UNSUPPORTED.items():
        value = kwargs.get(arg)
        if value is not None:
            shown = repr(value) if isinstance(value, (int, float)) else f"<{type(value).__name__}>"
            raise NotImplementedError(
                f"attention_dispatch: {_model_name(module)} passes {arg}={shown}, {what}; ad.sdpa has no "
                f"argument for it, and dropping it would change the model's output. "
                f"Load this model with attn_implementation='eager'."
            )


def _score_features(kwargs: dict) -> dict:
    """softcap and sinks as ad.sdpa's arguments (a softcap of 0 is none, flash-attn's convention)."""
    features = {}
    softcap = kwargs.get("softcap")
    if softcap:
        features["softcap"] = float(softcap)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None:
        features["sinks"] = sinks
    return features


def _require_mask_function(module) -> None:
    """Without a mask function registered under the model's implementation name, transformers passes
    no mask at all, and padding would be silently ignored: refuse."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if name is not None and name not in AttentionMaskInterface._global_mapping:
        raise ValueError(
            f"attention_dispatch: attn_implementation={name!r} has no mask function in transformers' "
            "AttentionMaskInterface, so the model would get no padding mask; register both with "
            f"attention_dispatch.integrations.transformers.register({name!r})"
        )


def _layer_window(module, kwargs: dict) -> int | None:
    """The sliding window of this attention layer (None: full attention)."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return window  # every layer slides (Mistral, Phi-MoE)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise NotImplementedError(
            f"attention_dispatch: {_model_name(module)} has sliding-window layers (config.layer_types) but this "
            "attention module passes no sliding_window and has no layer_idx, so its window is unknown"
        )
    return window if layer_types[layer_idx] == "sliding_attention" else None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D),
    the mask from ``attention_mask()`` -> ((B, Sq, Hq, Dv), None)."""
    _refuse_unsupported(module, kwargs)
    _require_mask_function(module)
    if kwargs.get("output_attentions", False):
        global _warned_output_attentions
        if not _warned_output_attentions:
            _warned_output_attentions = True
            logger.warning("attention_dispatch does not return attention weights (output_attentions=True): None")
    module_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = _layer_window(module, kwargs) if module_causal else None
    enable_gqa = key.shape[-3] != query.shape[-3]
    options = dict(dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa, deterministic=kwargs.get("deterministic"))
    options.update(_score_features(kwargs))

    if all(kwargs.get(n) is not None for n in _VARLEN_KWARGS):
        return _packed(module, query, key, value, position_bias, module_causal, window, kwargs, options), None

    q_length = query.shape[2]
    causal = None
    if attention_mask is None and module_causal and q_length > 1:
        causal = "top_left"
        if key.shape[2] > q_length:  # an empty static cache's prefill: the keys past the queries are unused
            key, value = key[:, :, :q_length], value[:, :, :q_length]
            if position_bias is not None:
                position_bias = position_bias[..., :q_length]
    mask = attention_mask
    if position_bias is not None:
        if mask is None:
            mask = position_bias
        elif mask.dtype == torch.bool:
            mask = torch.where(mask, position_bias, torch.finfo(position_bias.dtype).min)
        else:
            mask = position_bias + mask
    out = sdpa(
        query,
        key,
        value,
        attn_mask=mask,
        causal=causal,
        window=None if window is None or attention_mask is not None else (window - 1, 0),
        **options,
    )
    return out.transpose(1, 2).contiguous(), None


def _packed(module, query, key, value, position_bias, module_causal, window, kwargs, options) -> torch.Tensor:
    """A padding-free packed batch: (B, H, T, D) with cu_seq_lens over the B*T tokens -> one varlen call."""
    if position_bias is not None:
        raise NotImplementedError(
            f"attention_dispatch: {_model_name(module)} passes a position bias with a packed batch "
            "(cu_seq_lens_q/k); a varlen call takes no bias. Pad the batch instead."
        )
    b, hq, t, _ = query.shape
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value))
    cu_q, cu_k = (kwargs[n] for n in ("cu_seq_lens_q", "cu_seq_lens_k"))
    out = sdpa(
        q,
        k,
        v,
        causal="bottom_right" if module_causal else None,
        window=None if window is None else (window - 1, 0),
        cu_seqlens_q=cu_q if cu_q.dtype == torch.int32 else cu_q.to(torch.int32),
        cu_seqlens_k=cu_k if cu_k.dtype == torch.int32 else cu_k.to(torch.int32),
        max_seqlen_q=int(kwargs["max_length_q"]),
        max_seqlen_k=int(kwargs["max_length_k"]),
        **options,
    )
    return out.reshape(b, t, hq, out.shape[-1])
