"""The `math` backend: DESIGN.md section 3 in plain PyTorch, the test oracle.

Queries are processed in chunks so that no Sq x Sk matrix is ever allocated; under
autograd each chunk is checkpointed, which bounds the backward's memory too. Dropout's
keep-mask is the tl kernels' Philox stream keyed by position (dropout_stream.py): the same
mask as the triton backend's for a seed, independent of the chunking, and drawable at a
block's offset inside a larger call (Capabilities.dropout_positions). GQA folds the query-head group into
the rows of one matmul per key/value head, so K and V are never repeated.  Calls against a
KV cache (sdpa_with_kvcache) run one sequence at a time over its own keys.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from ..dropout_stream import DropoutStream, current, draw_seed, keep_mask
from ..features import lse_dtype
from ..semantics import band
from .base import Backend, Capabilities, check_backward_options, check_dkv_out, check_dq_accumulator, check_split

# Elements of one chunk's score block (B * Hq * rows * Sk): 2**24 fp32 is 64 MiB.
CHUNK_ELEMENTS = 1 << 24


def _empty_output(query, key, value, shape, attn_mask=None):
    # Keep the graph connected so that backward gives zero gradients, not an error (nor None
    # for a float mask that requires grad).
    zero = (query.sum() + key.sum() + value.sum()) * 0
    if attn_mask is not None and attn_mask.is_floating_point():
        zero = zero + attn_mask.sum().to(zero.dtype) * 0
    return query.new_zeros(shape) + zero.to(query.dtype)


def _chunk_attention(
    q,
    k,
    v,
    bias,
    row0,
    seqlen_q,
    seqlen_k,
    bottom_right,
    left,
    right,
    scale,
    dropout_p,
    stream,
    softcap,
    slopes,
    sinks,
    need_lse,
):
    """One chunk of query rows.

    q (B, Hkv, G, c, D) in compute dtype, k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), bias None or
    4-D broadcastable to (B, Hq, c, Sk) (bool or float), slopes None or (B, Hkv, G) ALiBi slopes, sinks
    None or (Hkv, G), stream the DropoutStream of dropout_p > 0; returns (B, Hkv, G, c, Dv) and, when need_lse, the rows' logsumexp
    (B, Hkv, G, c) without the sinks (else None).
    """
    b, hkv, g, c, d = q.shape
    sk = k.shape[-2]
    scores = torch.matmul(q.reshape(b, hkv, g * c, d), k.transpose(-1, -2)).view(b, hkv, g, c, sk)
    scores = scores * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(row0, row0 + c, device=q.device).unsqueeze(1)
    cols = torch.arange(sk, device=q.device).unsqueeze(0)
    diag = rows + (seqlen_k - seqlen_q if bottom_right else 0)  # the diagonal of window and ALiBi
    if slopes is not None:
        scores = scores - slopes[..., None, None].to(scores.dtype) * (diag - cols).abs().to(scores.dtype)
    allowed = None
    if left >= 0 or right >= 0:
        allowed = torch.ones(c, sk, dtype=torch.bool, device=q.device)
        if left >= 0:
            allowed &= cols >= diag - left
        if right >= 0:
            allowed &= cols <= diag + right
    if bias is not None:
        # a float bias in compute dtype before it is broadcast: its gradient is summed over the
        # broadcast dims in compute dtype and rounded once (summing rounded shares put bf16 mask
        # gradients ~1 ulp off, where F.sdpa's are 0.5)
        bias = bias if bias.dtype == torch.bool else bias.to(scores.dtype)
        bias = bias.expand(b, hkv * g, c, sk).reshape(b, hkv, g, c, sk)
        if bias.dtype == torch.bool:
            allowed = bias if allowed is None else bias & allowed
        else:
            scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    # A row with no allowed key has max -inf: shift by 0 instead so it gives 0, not NaN.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, torch.ones_like(total))  # no log(0) even in the unused branch
    lse = None
    if need_lse or sinks is not None:
        lse = torch.where(nonempty, row_max + torch.log(safe_total), torch.full_like(total, -math.inf))
    if sinks is None:
        probs = weights / safe_total
    else:  # P = exp(s - logaddexp(lse, sink)): exact for any sink, an empty row included (lse -inf)
        norm = torch.logaddexp(lse, sinks[..., None, None].to(lse.dtype))
        probs = torch.exp(scores - norm)
    if dropout_p > 0:
        hq = hkv * g
        bh = torch.arange(b, device=q.device)[:, None, None] * hq + torch.arange(hq, device=q.device).view(hkv, g)
        keep = keep_mask(stream, dropout_p, bh, hq, c, row0, sk)
        probs = probs * keep / (1.0 - dropout_p)
    out = torch.matmul(probs.view(b, hkv, g * c, sk), v).view(b, hkv, g, c, v.shape[-1])
    return out, (lse.squeeze(-1) if need_lse else None)


def dense_math_attention(
    query,
    key,
    value,
    attn_mask,
    *,
    scale,
    bottom_right,
    left,
    right,
    dropout_p=0.0,
    dropout_stream=None,
    chunk_elements=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
):
    """query (B, Hq, Sq, D), key (B, Hkv, Sk, D), value (B, Hkv, Sk, Dv); attn_mask None or
    broadcastable to (B, Hq, Sq, Sk); alibi_slopes None or (B, Hq); sinks None or (Hq,). The band
    is `semantics.band`'s; dropout_stream: where the keep-mask is drawn (default: a new seed,
    this call's own positions). Returns (B, Hq, Sq, Dv), and with return_lse the logsumexp (B, Hq, Sq)
    (float32, float64 for float64 inputs)."""
    b, hq, sq, d = query.shape
    hkv, sk, dv = key.shape[1], key.shape[2], value.shape[-1]
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    if 0 in (b, hq, sq, sk):
        out = _empty_output(query, key, value, (b, hq, sq, dv), attn_mask)
        if sinks is not None and sinks.requires_grad:  # keep sinks in the graph: a zero gradient
            out = out + (sinks.sum() * 0).to(out.dtype)
        if not return_lse:
            return out
        return out, query.new_full((b, hq, sq), -math.inf, dtype=compute)
    group = hq // hkv
    q = query.to(compute).reshape(b, hkv, group, sq, d)
    k, v = key.to(compute), value.to(compute)
    # broadcast per chunk, after a float mask's conversion (_chunk_attention)
    bias = None if attn_mask is None else attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    slopes = None if alibi_slopes is None else alibi_slopes.reshape(b, hkv, group)
    sink_logits = None if sinks is None else sinks.to(compute).reshape(hkv, group)
    if dropout_p > 0 and dropout_stream is None:
        dropout_stream = DropoutStream(draw_seed(query.device), 0, 0, 0, sq, sk)
    rows = max(1, min(sq, (chunk_elements or CHUNK_ELEMENTS) // max(1, b * hq * sk)))
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_mask, sinks)
    )
    outs, lses = [], []
    # one chunk where it holds every row: no range() over Sq, which torch.compile would
    # specialise where Sq is symbolic (mark_dynamic)
    for row0 in (0,) if rows >= sq else range(0, sq, rows):
        row1 = sq if rows >= sq else min(sq, row0 + rows)
        args = (
            q[:, :, :, row0:row1],
            k,
            v,
            bias if bias is None or bias.shape[2] == 1 else bias[:, :, row0:row1],
            row0,
            sq,
            sk,
            bottom_right,
            left,
            right,
            scale,
            dropout_p,
            dropout_stream,
            softcap,
            slopes,
            sink_logits,
            return_lse,
        )
        if grad and rows < sq:
            out, lse = checkpoint(_chunk_attention, *args, use_reentrant=False)
        else:
            out, lse = _chunk_attention(*args)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    out = out.reshape(b, hq, sq, dv).to(query.dtype)
    if not return_lse:
        return out
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=3)
    return out, lse.reshape(b, hq, sq)


def math_attention(
    query,
    key,
    value,
    *,
    attn_mask=None,
    dropout_p=0.0,
    causal=None,
    window=None,
    scale=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    chunk_elements=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
    **_,
):
    """The normalised call (DESIGN.md section 4) computed exactly; dense or varlen. With
    return_lse, also the logsumexp: dense (B, Hq, Sq), varlen (Hq, total_q). Dropout: one
    seed per call (the triton backend's draw), or the positioned stream in scope."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    bottom_right, left, right = band(causal, window)
    stream = current() if dropout_p > 0 else None
    if stream is not None and cu_seqlens_q is not None:
        raise ValueError(
            "a positioned dropout stream (dropout_stream.positioned) with varlen: the stream is keyed "
            "by (sequence, position in it), so a varlen call cannot be a block of a larger one"
        )
    seed = draw_seed(query.device) if dropout_p > 0 and stream is None else None
    common = dict(
        scale=scale,
        bottom_right=bottom_right,
        left=left,
        right=right,
        dropout_p=dropout_p,
        chunk_elements=chunk_elements,
        softcap=softcap,
        sinks=sinks,
        return_lse=return_lse,
    )
    if cu_seqlens_q is None:
        if seed is not None:
            stream = DropoutStream(seed, 0, 0, 0, query.shape[-2], key.shape[-2])
        return dense_math_attention(
            query, key, value, attn_mask, alibi_slopes=alibi_slopes, dropout_stream=stream, **common
        )
    # Varlen: each sequence is one dense problem; the mask is indexed by local positions.
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    if seed is not None and (max_seqlen_q is None or max_seqlen_k is None):  # called without them
        max_seqlen_q = max((b - a for a, b in zip(starts_q, starts_q[1:])), default=0)
        max_seqlen_k = max((b - a for a, b in zip(starts_k, starts_k[1:])), default=0)
    outs, lses = [], []
    for i in range(len(starts_q) - 1):
        q = query[starts_q[i] : starts_q[i + 1]].transpose(0, 1).unsqueeze(0)
        k = key[starts_k[i] : starts_k[i + 1]].transpose(0, 1).unsqueeze(0)
        v = value[starts_k[i] : starts_k[i + 1]].transpose(0, 1).unsqueeze(0)
        mask = None
        if attn_mask is not None:
            rows = attn_mask[min(i, attn_mask.shape[0] - 1)].unsqueeze(0)
            mask = rows[..., : q.shape[2] if rows.shape[-2] > 1 else 1, : k.shape[2] if rows.shape[-1] > 1 else 1]
        slopes = None if alibi_slopes is None else alibi_slopes[i : i + 1]
        # the kernels' varlen stream: sequence i as batch i of (max_seqlen_q, max_seqlen_k)
        stream = None if seed is None else DropoutStream(seed, i, 0, 0, max_seqlen_q, max_seqlen_k)
        result = dense_math_attention(q, k, v, mask, alibi_slopes=slopes, dropout_stream=stream, **common)
        out, lse = result if return_lse else (result, None)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse)
    if outs:
        out = torch.cat(outs)
    else:
        out = _empty_output(query, key, value, (0, query.shape[1], value.shape[-1]), attn_mask)
        if sinks is not None and sinks.requires_grad:  # no sequence: a zero gradient all the same
            out = out + (sinks.sum() * 0).to(out.dtype)
    if not return_lse:
        return out
    if lses:
        lse = torch.cat([x[0] for x in lses], dim=1)
    else:
        lse = query.new_zeros((query.shape[1], 0), dtype=lse_dtype(query.dtype))
    return out, lse


def _cache_rows(cache, b: int, length: int, block_table):
    """The first ``length`` keys (or values) of sequence b as (Hkv, length, D)."""
    if block_table is None:
        return cache[b, :, :length]
    page = cache.shape[1]
    blocks = block_table[b, : -(-length // page)].long()
    return cache[blocks].flatten(0, 1)[:length].transpose(0, 1)


def math_attention_with_kvcache(
    query,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    k_new=None,
    v_new=None,
    block_table=None,
    causal=None,
    window=None,
    scale,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
):
    """sdpa_with_kvcache()'s call from its definition, one sequence at a time: k_new/v_new
    written into the cache at positions cache_seqlens[b]... (in place), then sequence b's
    queries attend to its first L_b = cache_seqlens[b] (+ Sq) keys, causal, window and ALiBi
    aligned bottom-right against L_b.  Reads cache_seqlens on the host."""
    b, hq, sq, _ = query.shape
    lengths = cache_seqlens.tolist()
    if k_new is not None:
        for i, start in enumerate(lengths):
            if block_table is None:
                k_cache[i, :, start : start + sq] = k_new[i]
                v_cache[i, :, start : start + sq] = v_new[i]
            else:
                page = k_cache.shape[1]
                pos = torch.arange(start, start + sq, device=query.device)
                blocks = block_table[i].long()[pos // page]
                k_cache[blocks, pos % page] = k_new[i].transpose(0, 1)
                v_cache[blocks, pos % page] = v_new[i].transpose(0, 1)
        lengths = [n + sq for n in lengths]
    _, left, right = band(causal, window)
    results = [
        dense_math_attention(
            query[i : i + 1],
            _cache_rows(k_cache, i, n, block_table).unsqueeze(0),
            _cache_rows(v_cache, i, n, block_table).unsqueeze(0),
            None,
            scale=scale,
            bottom_right=True,
            left=left,
            right=right,
            softcap=softcap,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes[i : i + 1],
            sinks=sinks,
            return_lse=return_lse,
        )
        for i, n in enumerate(lengths)
    ]
    if not return_lse:
        return torch.cat(results) if results else query.new_zeros(b, hq, sq, v_cache.shape[-1])
    if not results:
        return query.new_zeros(b, hq, sq, v_cache.shape[-1]), query.new_zeros(b, hq, sq, dtype=lse_dtype(query.dtype))
    return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])


class MathBackend(Backend):
    """Reference implementation of every feature; always available, never fast."""

    name = "math"
    reference = True
    capabilities = Capabilities(
        head_dim_min=0,  # head dim 0: scores are the bias alone, as in F.sdpa
        kv_cache=frozenset({"dense", "paged"}),  # any block size
        softcap=True,
        alibi=True,
        sinks=True,
        sinks_grad=True,
        return_lse=True,
        lse_grad=True,
        second_derivatives=True,  # its backward is differentiable torch ops (checkpointed chunks)
        forward_ad=True,  # so is its forward
        func_transforms=True,
        dropout_positions=True,
        backward_from_output=True,
        backward_dq_accumulator=True,
        backward_dkv_out=True,
        backward_split=True,
        notes="reference; query-chunked, bounded memory; the test oracle in float64",
    )

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def run(self, query, key, value, **options):
        return math_attention(query, key, value, **options)

    def run_backward(
        self,
        query,
        key,
        value,
        out,
        lse,
        grad_out,
        grad_lse,
        dq_accumulator=None,
        dkv_out=None,
        only=None,
        dq_out=None,
        **options,
    ):
        """Base.run_backward's gradients by autograd through this call recomputed, (out_b, lse_b):
        with w = exp(lse_b - lse), exp(s - lse) = w exp(s - lse_b), so the given lse's dS is the
        call's backward for d out_b = w dO and d lse_b = w (rowsum(dO out_b) - rowsum(dO out) + grad_lse);
        dq added into ``dq_accumulator``, dk/dv copied into ``dkv_out`` (after autograd read the keys)
        where given; ``only`` returns one of them (both computed: a reference, not a saving)."""
        check_backward_options(options)
        check_split(only, dq_out, query, dq_accumulator)
        check_dq_accumulator(dq_accumulator, query)
        check_dkv_out(dkv_out, key, value)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (query, key, value)]
            out_b, lse_b = math_attention(*leaves, **dict(options, return_lse=True))
            compute = lse_b.dtype
            weight = torch.where(torch.isfinite(lse), torch.exp(lse_b.detach() - lse), torch.zeros_like(lse_b))
            dout = grad_out.to(compute)
            delta = (dout * out.to(compute)).sum(-1) - (0 if grad_lse is None else grad_lse.to(compute))
            inner = (dout * out_b.detach().to(compute)).sum(-1)
            grads = ((weight.unsqueeze(-1) * dout).to(out_b.dtype), weight * (inner - delta))
            dq, dk, dv = torch.autograd.grad((out_b, lse_b), leaves, grads, materialize_grads=True)
        if only == "dq":
            dk = dv = None
        elif dkv_out is not None:
            dk, dv = dkv_out[0].copy_(dk), dkv_out[1].copy_(dv)
        if only == "dkv":
            return None, dk, dv
        if dq_out is not None:
            dq = dq_out.copy_(dq)
        if dq_accumulator is None:
            return dq, dk, dv
        dq_accumulator.add_(dq)
        return None, dk, dv

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, **options):
        return math_attention_with_kvcache(query, k_cache, v_cache, cache_seqlens, **options)
