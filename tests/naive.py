"""An independent, deliberately naive float64 reference of DESIGN.md section 3.

It shares no code with the package: it is what the `math` backend and every kernel are
checked against. Full S x S matrices, one (batch, head) at a time: only for small shapes.
"""

from __future__ import annotations

import math

import torch


def _allowed(sq: int, sk: int, causal: str | None, window: tuple[int, int] | None) -> torch.Tensor:
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal == "top_left":
        ok &= j <= i
    elif causal == "bottom_right":
        ok &= j <= i + (sk - sq)
    if window is not None:
        off = 0 if causal == "top_left" else sk - sq
        left, right = window
        if left >= 0:
            ok &= j >= i + off - left
        if right >= 0:
            ok &= j <= i + off + right
    return ok


def _one(q, k, v, bias, keep, dropout_p, scale, causal, window, softcap=None, slopes=None, sinks=None, dots=None):
    """q (Hq, Sq, D), k (Hkv, Sk, D), v (Hkv, Sk, Dv); bias/keep broadcastable to (Hq, Sq, Sk);
    slopes (Hq,) ALiBi slopes of this batch entry; sinks (Hq,) one extra logit per head; ``dots``: called
    with each head's q k^T (Sq, Sk), q_h, its kv head's k, that kv head's index and the softmax over the
    allowed keys without sinks or dropout (Sq, Sk)."""
    hq, sq, _ = q.shape
    hkv, sk, _ = k.shape
    group = hq // hkv
    if sq == 0 or sk == 0:
        return q.new_zeros(hq, sq, v.shape[-1]), q.new_full((hq, sq), -math.inf)
    # on q's device: GPU tests build their input-dtype reference there
    allowed = _allowed(sq, sk, causal, window).to(q.device)
    off = 0 if causal == "top_left" else sk - sq
    pos_q, pos_k = torch.arange(sq, device=q.device), torch.arange(sk, device=q.device)
    distance = (pos_q.unsqueeze(1) + off - pos_k.unsqueeze(0)).abs().to(q.dtype)
    rows = []
    for h in range(hq):
        qk = q[h] @ k[h // group].T
        s = scale * qk
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            s = s - slopes[h].to(s.dtype) * distance
        ok = allowed.clone()
        if bias is not None:
            b = bias[h] if bias.dim() == 3 else bias
            if b.dtype == torch.bool:
                ok = ok & b.expand(sq, sk)
            else:
                s = s + b.expand(sq, sk)
        s = s.masked_fill(~ok, -math.inf)
        m = s.max(dim=-1, keepdim=True).values
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m) * ok
        z = e.sum(-1, keepdim=True)
        if dots is not None:
            dots(qk, q[h], k[h // group], h // group, torch.where(z > 0, e / torch.where(z > 0, z, 1), 0).detach())
        if sinks is not None:
            # shifted by the larger of the row's max and the sink: exp(sink - m) overflowed in float32 when
            # every key's score sat far below the sink (its backward then gave NaN)
            m_sink = torch.maximum(m, sinks[h].to(s.dtype))
            e = torch.exp(s - m_sink) * ok
            denominator = e.sum(-1, keepdim=True) + torch.exp(sinks[h].to(s.dtype) - m_sink)
        else:
            denominator = z
        p = torch.where(z > 0, e / torch.where(z > 0, denominator, torch.ones_like(z)), torch.zeros_like(e))
        if keep is not None:
            kp = keep[h] if keep.dim() == 3 else keep
            p = p * kp.expand(sq, sk).to(p.dtype) / (1.0 - dropout_p)
        rows.append(
            (
                p @ v[h // group],
                torch.where(
                    z.squeeze(-1) > 0,
                    (m + torch.log(torch.where(z > 0, z, torch.ones_like(z)))).squeeze(-1),  # no log(0) in the graph
                    torch.full_like(z.squeeze(-1), -math.inf),
                ),
            )
        )
    out = torch.stack([r[0] for r in rows])
    lse = torch.stack([r[1] for r in rows])
    return out, lse


def _recorder(dot_products, entry: int):
    """What _one calls with each head's dot products: appends them to ``dot_products`` tagged with the entry."""
    return None if dot_products is None else (lambda *record: dot_products.append((entry, *record)))


def naive_attention(
    q,
    k,
    v,
    *,
    mask=None,
    causal=None,
    window=None,
    scale=None,
    keep=None,
    dropout_p=0.0,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    return_lse=False,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    dot_products=None,
):
    """Dense: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv).
    Varlen: q (total_q, Hq, D) etc. with cu_seqlens; mask/keep then index (B, Hq, i, j)
    with positions local to each sequence (broadcastable to (B, Hq, max_sq, max_sk)).
    causal: None | "top_left" | "bottom_right"; window: (left, right) with -1 unbounded.
    keep: the dropout keep-mask (True = kept), applied with 1/(1-dropout_p) scaling.
    softcap: s = softcap * tanh(scale <q, k> / softcap) before bias; alibi_slopes (Hq,) or (B, Hq):
    adds -slope * |i + off - j| (off = 0 for top-left causal, Sk - Sq otherwise); sinks (Hq,): one
    extra logit per head in each row's softmax denominator, carrying no value (the returned lse
    leaves it out). Computes in the inputs' dtype (pass float64 for the oracle).
    dot_products: a list given, per batch entry or sequence and query head, (that entry's index, the
    head's q k^T (Sq, Sk) in the graph, its q (Sq, D), its kv head's k (Sk, D), the kv head's index, the
    softmax over its allowed keys without sinks or dropout): gradients with respect to q k^T are a
    backward's dS times the scale."""
    hq_all = q.shape[1] if cu_seqlens_q is not None else q.shape[-3]
    slopes = None
    if alibi_slopes is not None:
        nb = (len(cu_seqlens_q) - 1) if cu_seqlens_q is not None else q.shape[0]
        slopes = alibi_slopes.reshape(-1, hq_all).expand(nb, hq_all)
    extra = dict(softcap=softcap, sinks=sinks)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if cu_seqlens_q is None:
        b, hq, sq, _ = q.shape
        sk = k.shape[-2]
        bias = None if mask is None else mask.expand(b, hq, sq, sk)
        kp = None if keep is None else keep.expand(b, hq, sq, sk)
        res = [
            _one(
                q[i],
                k[i],
                v[i],
                None if bias is None else bias[i],
                None if kp is None else kp[i],
                dropout_p,
                scale,
                causal,
                window,
                slopes=None if slopes is None else slopes[i],
                dots=_recorder(dot_products, i),
                **extra,
            )
            for i in range(b)
        ]
        out = torch.stack([r[0] for r in res])
        lse = torch.stack([r[1] for r in res])
        return (out, lse) if return_lse else out
    cq = [int(x) for x in cu_seqlens_q]
    ck = [int(x) for x in cu_seqlens_k]
    b = len(cq) - 1
    hq = q.shape[1]
    outs, lses = [], []
    for i in range(b):
        qi = q[cq[i] : cq[i + 1]].transpose(0, 1)
        ki = k[ck[i] : ck[i + 1]].transpose(0, 1)
        vi = v[ck[i] : ck[i + 1]].transpose(0, 1)
        sq, sk = qi.shape[1], ki.shape[1]

        def crop(t):
            if t is None:
                return None
            t = t.expand(b, hq, max(t.shape[-2], sq), max(t.shape[-1], sk))
            return t[i, :, :sq, :sk]

        o, l = _one(
            qi,
            ki,
            vi,
            crop(mask),
            crop(keep),
            dropout_p,
            scale,
            causal,
            window,
            slopes=None if slopes is None else slopes[i],
            dots=_recorder(dot_products, i),
            **extra,
        )
        outs.append(o.transpose(0, 1))
        lses.append(l.transpose(0, 1))
    out = torch.cat(outs) if outs else q.new_zeros(0, hq, v.shape[-1])
    lse = torch.cat(lses) if lses else q.new_zeros(0, hq)
    return (out, lse) if return_lse else out
