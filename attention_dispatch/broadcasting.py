"""F.scaled_dot_product_attention's broadcasting of dense inputs: query, key and value of any
rank >= 2 brought to (B, H, S, D), and a mask's batch dims folded to match (call.py validates
the rest of the call).
"""

from __future__ import annotations


def shape_text(t) -> str:
    """A tensor's shape for an error message: "(2, 8, 128, 64)"."""
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_heads(hq: int, hkv: int, hv: int, enable_gqa: bool) -> None:
    """Key and value share their heads; query heads equal them, or (enable_gqa) are a multiple."""
    if hkv != hv:
        raise ValueError(f"key has {hkv} heads but value has {hv}; they must match")
    if hq != hkv:
        if not enable_gqa:
            raise ValueError(
                f"query has {hq} heads but key/value have {hkv}; pass enable_gqa=True for grouped-query attention"
            )
        if hkv == 0 or hq % hkv:
            raise ValueError(f"enable_gqa=True needs query heads ({hq}) to be a multiple of key/value heads ({hkv})")


def dense_layout(query, key, value, enable_gqa: bool):
    """Bring dense inputs of any rank >= 2 to (B, H, S, D), broadcasting as F.sdpa does:
    leading batch dims broadcast against each other (a 4-D query with 3-D key/value
    included), and a single key/value head serves every query head (a single query head
    meets every key/value head).  Returns the canonical tensors, the output's shape in the
    caller's layout (None when it is the canonical one) and the leading dims of the mask's
    target."""
    qs, ks, vs = query.shape, key.shape, value.shape
    if (
        len(qs) == len(ks) == len(vs) == 4
        and qs[0] == ks[0] == vs[0]
        and ks[1] == vs[1]
        and ks[2] == vs[2]
        and qs[3] == ks[3]
        and (qs[1] == ks[1] or (enable_gqa and ks[1] and qs[1] % ks[1] == 0))
    ):  # the common call: nothing to broadcast
        return query, key, value, None, (qs[0], qs[1])
    ranks = (query.dim(), key.dim(), value.dim())
    if min(ranks) < 2:
        raise ValueError(
            "query, key and value need at least 2 dims ((L, E), (N, L, E) or (*batch, H, L, E)), "
            f"got {shape_text(query)}, {shape_text(key)}, {shape_text(value)}"
        )
    rank = max(ranks)
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key has {key.shape[-2]} positions but value has {value.shape[-2]}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query head_dim {query.shape[-1]} != key head_dim {key.shape[-1]}")
    full = max(rank, 4)
    q, k, v = (
        t if t.dim() == full else t.reshape((1,) * (full - t.dim()) + tuple(t.shape)) for t in (query, key, value)
    )
    batch = []
    for sizes in zip(q.shape[:-3], k.shape[:-3], v.shape[:-3]):
        size = max(sizes)
        if any(n not in (1, size) for n in sizes):
            raise ValueError(
                f"batch dims do not broadcast: query {shape_text(query)}, key {shape_text(key)}, value {shape_text(value)}"
            )
        batch.append(size)
    batch = tuple(batch)
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk != hv and 1 in (hk, hv):  # one of key/value broadcasts over the other's heads
        hk = hv = max(hk, hv)
    heads_out = hq
    if hq != hk and not (enable_gqa and hk and hq % hk == 0):
        if hk == 1:
            pass  # one key/value head for every query head: MQA, no copy
        elif hq == 1:
            heads_out = hk  # one query head against every key/value head
        else:
            check_heads(hq, hk, hv, enable_gqa)
    check_heads(heads_out, hk, hv, True)

    def canonical(t, heads):
        want = batch + (heads,) + tuple(t.shape[-2:])
        if tuple(t.shape) != want:  # broadcast: copy, so every backend sees ordinary strides
            t = t.expand(want).contiguous()
        return t if t.dim() == 4 else t.reshape((-1,) + want[-3:])

    q, k, v = canonical(q, heads_out), canonical(k, hk), canonical(v, hk)
    out_shape = (batch + (heads_out,))[len(batch) + 1 - (rank - 2) :] + (q.shape[2], v.shape[3])
    same = rank == 4 and q is query and k is key and v is value
    return q, k, v, None if same else out_shape, batch + (heads_out,)


def fold_mask_batch(mask, batch: tuple[int, ...]):
    """A mask of rank len(batch) + 3 -> 4-D: its batch dims folded into one."""
    if len(batch) == 1:
        return mask
    lead = tuple(mask.shape[: len(batch)])
    if all(n == 1 for n in lead):
        return mask.reshape((1,) + tuple(mask.shape[len(batch) :]))
    return mask.expand(batch + tuple(mask.shape[len(batch) :])).reshape((-1,) + tuple(mask.shape[len(batch) :]))
