"""torch.autocast around sdpa(): the inputs cast as autocast casts F.scaled_dot_product_attention's."""

from __future__ import annotations

import torch


def autocast_inputs(query, key, value, attn_mask):
    """(query, key, value, attn_mask) as autocast hands them to F.sdpa when it is on for the
    query's device type: each floating tensor of that device type other than float64 cast to the
    autocast dtype (a float mask too); bool masks, float64 tensors and other devices' unchanged.
    None when autocast is off there. So a call under autocast is dispatched at the dtype F.sdpa
    would run it at; the caller then runs it with autocast off, so that no backend's own torch ops
    (the math reference's float32 products included) are recast."""
    if not isinstance(query, torch.Tensor):  # normalize_call names what was given
        return None
    device_type = query.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None  # (meta tensors: no autocast for that device type)
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        if t is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64) or t.device.type != device_type:
            return t
        return t.to(dtype)

    return cast(query), cast(key), cast(value), cast(attn_mask)
