"""Random attention problems for tests: fresh inputs each time, never zeros."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 4
    seqlen_q: int = 24
    seqlen_k: int = 24
    head_dim: int = 32
    head_dim_v: int | None = None
    causal: str | None = None
    window: tuple[int, int] | None = None
    mask: str = "none"  # none | bool | float | float_grad
    mask_shape: str = "full"  # full | heads | keys | square (2-D)
    # float32 for a float32 bias with 16-bit inputs (values near 100: rounding it would show)
    mask_dtype: torch.dtype | None = None
    dropout_p: float = 0.0
    varlen: tuple[int, ...] | None = None  # per-sequence q lengths (k lengths = q + extra_k)
    extra_k: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32
    softcap: float | None = None
    alibi: str | None = None  # ALiBi slopes of shape "heads" (Hq,) or "batch" (B, Hq)
    sinks: str | None = None  # "fixed" or "grad" (the sinks require grad)
    sink_mean: float = 1.0  # the sinks ~ N(sink_mean, 1): far above the scores, a sink takes ~all the weight
    return_lse: bool = False

    def __str__(self):
        fields = [
            f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if getattr(self, f.name) != f.default
        ]
        return ",".join(fields) or "default"


def make_inputs(case: Case, device="cpu", requires_grad=True):
    """Tensors plus sdpa keyword arguments for `case`, and the naive reference's kwargs."""
    dv = case.head_dim_v or case.head_dim
    kw = dict(device=device, dtype=case.dtype)
    sdpa_kw, naive_kw = {}, {}
    if case.varlen is not None:
        lq = list(case.varlen)
        lk = [a + b for a, b in zip(lq, case.extra_k or [0] * len(lq))]
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device=device)
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device=device)
        q = torch.randn(sum(lq), case.heads_q, case.head_dim, **kw)
        k = torch.randn(sum(lk), case.heads_kv, case.head_dim, **kw)
        v = torch.randn(sum(lk), case.heads_kv, dv, **kw)
        b, sq, sk = len(lq), max(lq, default=0), max(lk, default=0)
        sdpa_kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        naive_kw.update(cu_seqlens_q=cu_q.cpu(), cu_seqlens_k=cu_k.cpu())
    else:
        b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
        q = torch.randn(b, case.heads_q, sq, case.head_dim, **kw)
        k = torch.randn(b, case.heads_kv, sk, case.head_dim, **kw)
        v = torch.randn(b, case.heads_kv, sk, dv, **kw)
    mask = None
    if case.mask != "none":
        shape = {
            "full": (b, case.heads_q, sq, sk),
            "heads": (1, case.heads_q, sq, sk),
            "keys": (b, 1, 1, sk),
            "square": (sq, sk),
        }[case.mask_shape]
        if case.mask == "bool":
            mask = torch.rand(shape, device=device) > 0.25
        elif case.mask_dtype is not None:
            mask = torch.randn(shape, device=device, dtype=case.mask_dtype) * 2 + 100
        else:
            mask = torch.randn(shape, **kw)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    if mask is not None and case.mask == "float_grad":
        mask.requires_grad_(True)
    if case.heads_q != case.heads_kv:
        sdpa_kw["enable_gqa"] = True
    if case.causal:
        sdpa_kw["causal"] = case.causal
        naive_kw["causal"] = case.causal
    if case.window:
        sdpa_kw["window"] = case.window
        naive_kw["window"] = case.window
    if case.dropout_p:
        sdpa_kw["dropout_p"] = case.dropout_p
        naive_kw["dropout_p"] = case.dropout_p
    if case.softcap is not None:
        sdpa_kw["softcap"] = naive_kw["softcap"] = case.softcap
    if case.alibi is not None:
        shape = (case.heads_q,) if case.alibi == "heads" else (b, case.heads_q)
        slopes = torch.rand(shape, device=device, dtype=torch.float32) * 0.5 + 0.05
        sdpa_kw["alibi_slopes"], naive_kw["alibi_slopes"] = slopes, slopes.cpu().double()
    if case.sinks is not None:  # naive_kw gets the same tensor: callers make their own leaf copies
        sinks = torch.randn(case.heads_q, device=device, dtype=case.dtype) + case.sink_mean
        sinks = sinks.requires_grad_(case.sinks == "grad")
        sdpa_kw["sinks"] = naive_kw["sinks"] = sinks
    if case.return_lse:
        sdpa_kw["return_lse"] = naive_kw["return_lse"] = True
    return q, k, v, mask, sdpa_kw, naive_kw


# memory layouts a (B, H, S, D) or (total, H, D) tensor may come in with the same values: the strides
# each kernel reads a tensor through, drawn for every tensor apart (the fuzzers' layouts)
LAYOUTS = ("contiguous", "tokens_first", "every_other", "padded_rows")


def restrided(t, layout: str):
    """A leaf with ``t``'s values and requires_grad in memory layout ``layout``: ``tokens_first`` a
    (B, S, H, D) buffer seen as (B, H, S, D) (3-d: (H, total, D)), ``every_other`` every other element
    of a buffer twice as wide, ``padded_rows`` rows of D + 3 elements; ``t`` itself for "contiguous"."""
    if layout == "contiguous" or t.dim() < 3:
        return t
    with torch.no_grad():
        if layout == "tokens_first":
            a, b = (1, 2) if t.dim() == 4 else (0, 1)
            out = t.transpose(a, b).contiguous().transpose(a, b)
        else:
            d = t.shape[-1]
            buf = torch.empty(
                *t.shape[:-1], 2 * d if layout == "every_other" else d + 3, dtype=t.dtype, device=t.device
            )
            out = buf[..., ::2] if layout == "every_other" else buf[..., :d]
            out.copy_(t)
    return out.requires_grad_(t.requires_grad)


def leaf_copy(t, dtype=None):
    """A detached copy (optionally cast) that requires grad like `t`."""
    if t is None:
        return None
    c = t.detach().to(dtype or t.dtype).clone()
    return c.requires_grad_(t.requires_grad)


def cpu_backends_declaring(claim: str) -> list[str]:
    """The available backends whose Capabilities set ``claim``, for tests on CPU tensors (triton
    only under the interpreter): one test item per backend that makes the claim."""
    import os

    import attention_dispatch as ad
    from attention_dispatch import registry

    names = []
    for name in ad.list_backends():
        backend = registry.get_backend(name)
        if not getattr(backend.capabilities, claim) or not backend.is_available():
            continue
        if name == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            continue  # CPU tensors: the kernels under the interpreter only
        names.append(name)
    return names
