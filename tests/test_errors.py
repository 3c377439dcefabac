"""Bad input: a clear error naming the argument, what was given and what is allowed."""

import inspect

import pytest
import torch

import attention_dispatch as ad


def t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


Q, K, V = t(2, 4, 8, 16), t(2, 4, 10, 16), t(2, 4, 10, 16)
CU = torch.tensor([0, 3, 8], dtype=torch.int32)
PQ, PK, PV = t(8, 4, 16), t(8, 4, 16), t(8, 4, 16)

CASES = [
    ((Q, K, V, None, 0.0, False, None, False, "top_left"), {}, TypeError, "takes from 3 to 8 positional arguments"),
    (([[1.0]], K, V), {}, TypeError, "query must be a torch.Tensor, got list"),
    ((Q.long(), K.long(), V.long()), {}, TypeError, "query.dtype=int64 is not allowed; allowed: float16"),
    ((Q, K.double(), V), {}, ValueError, "share one dtype, got query=torch.float32, key=torch.float64"),
    ((Q, t(2, 4, 10, 8), V), {}, ValueError, "query head_dim 16 != key head_dim 8"),
    ((Q, K, t(2, 4, 9, 16)), {}, ValueError, "key has 10 positions but value has 9"),
    ((Q, t(3, 4, 10, 16), t(3, 4, 10, 16)), {}, ValueError, "batch dims do not broadcast: query (2, 4, 8, 16)"),
    ((Q, K, t(2, 2, 10, 16)), {}, ValueError, "key has 4 heads but value has 2"),
    ((Q, t(2, 2, 10, 16), t(2, 2, 10, 16)), {}, ValueError, "pass enable_gqa=True"),
    ((Q, t(2, 3, 10, 16), t(2, 3, 10, 16)), dict(enable_gqa=True), ValueError, "multiple of key/value heads (3)"),
    ((t(16), t(4, 16), t(4, 16)), {}, ValueError, "need at least 2 dims ((L, E)"),
    ((Q, K, V), dict(dropout_p=1.5), ValueError, "dropout_p must be a float in [0, 1], got 1.5"),
    ((Q, K, V), dict(dropout_p=-0.1), ValueError, "dropout_p must be a float in [0, 1], got -0.1"),
    ((Q, K, V), dict(scale=float("nan")), ValueError, "scale must be None or a finite float, got nan"),
    ((Q, K, V), dict(scale=float("inf")), ValueError, "scale must be None or a finite float, got inf"),
    ((Q, K, V), dict(window=(-2, 0)), ValueError, "window left=-2 is negative; allowed: >= 0, or -1"),
    ((Q, K, V), dict(window=(3,)), TypeError, "window must be None or a (left, right) pair"),
    ((Q, K, V), dict(window=(1.5, 0)), TypeError, "window left must be an int, got float"),
    (
        (Q, K, V),
        dict(causal="upper"),
        ValueError,
        "causal='upper' is not allowed; use None, 'top_left', 'bottom_right' or True",
    ),
    ((Q, K, V), dict(is_causal=True, causal="bottom_right"), ValueError, "pass only one of them"),
    (
        (Q, K, V),
        dict(attn_mask=t(3, 8, 10)),
        ValueError,
        "attn_mask of shape (3, 8, 10) is not broadcastable to (B, Hq, Sq, Sk) = (2, 4, 8, 10)",
    ),
    ((Q, K, V), dict(attn_mask=t(8, 11)), ValueError, "not broadcastable"),
    (
        (Q, K, V),
        dict(attn_mask=torch.ones(8, 10, dtype=torch.int64)),
        TypeError,
        "attn_mask.dtype=torch.int64 is not allowed",
    ),
    (
        (Q, K, V),
        dict(attn_mask=t(8, 10, dtype=torch.float64)),
        TypeError,
        "attn_mask.dtype=float64 is not allowed with query.dtype=float32; allowed: bool (True = attend) or float32",
    ),
    (
        (Q.bfloat16(), K.bfloat16(), V.bfloat16()),
        dict(attn_mask=t(8, 10, dtype=torch.float16)),
        TypeError,
        "attn_mask.dtype=float16 is not allowed with query.dtype=bfloat16; allowed: bool (True = attend), float32 or bfloat16",
    ),
    ((Q, K, V), dict(enable_gqa=1), TypeError, "enable_gqa must be a bool"),
    ((Q, K, V), dict(deterministic="yes"), TypeError, "deterministic must be None or a bool"),
    ((PQ, PK, PV), dict(cu_seqlens_q=CU), ValueError, "cu_seqlens_q and cu_seqlens_k must be given together"),
    (
        (PQ, PK, PV),
        dict(cu_seqlens_q=CU.float(), cu_seqlens_k=CU),
        TypeError,
        "cu_seqlens_q.dtype=torch.float32 is not allowed",
    ),
    ((PQ, PK, PV), dict(cu_seqlens_q=[0, 3, 8], cu_seqlens_k=CU), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (
        (PQ, PK, PV),
        dict(cu_seqlens_q=CU.view(1, 3), cu_seqlens_k=CU),
        ValueError,
        "cu_seqlens_q must be 1-D of length batch+1",
    ),
    (
        (PQ, PK, PV),
        dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32), cu_seqlens_k=CU),
        ValueError,
        "cu_seqlens_q must start at 0, got 1",
    ),
    (
        (PQ, PK, PV),
        dict(
            cu_seqlens_q=torch.tensor([0, 5, 3, 8], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 1, 3, 8], dtype=torch.int32),
        ),
        ValueError,
        "must be non-decreasing",
    ),
    (
        (PQ, PK, PV),
        dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32), cu_seqlens_k=CU),
        ValueError,
        "must end at the packed length 8, got 7",
    ),
    (
        (PQ, PK, PV),
        dict(cu_seqlens_q=CU, cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_q has 3 entries but cu_seqlens_k has 2",
    ),
    (
        (PQ, PK, PV),
        dict(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=2),
        ValueError,
        "max_seqlen=2 for cu_seqlens_q is less than its longest sequence (5)",
    ),
    (
        (PQ, PK, PV),
        dict(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_k=-1),
        ValueError,
        "must be a non-negative int, got -1",
    ),
    (
        (Q, K, V),
        dict(cu_seqlens_q=CU, cu_seqlens_k=CU),
        ValueError,
        "with cu_seqlens, query must be packed (total, heads, head_dim)",
    ),
    (
        (PQ, PK, PV),
        dict(cu_seqlens_q=CU, cu_seqlens_k=CU, attn_mask=t(2, 4, 6, 5)),
        ValueError,
        "not broadcastable to (B, Hq, max_seqlen_q, max_seqlen_k) = (2, 4, 5, 5)",
    ),
]


@pytest.mark.parametrize("args,kwargs,exc,message", CASES, ids=[c[3][:40] for c in CASES])
def test_bad_input_message(args, kwargs, exc, message):
    for fn in (ad.sdpa, ad.explain):
        with pytest.raises(exc) as err:
            fn(*args, **kwargs)
        assert message in str(err.value), str(err.value)


def test_sdpa_shows_and_keeps_explains_signature():
    """sdpa() declares its options after enable_gqa behind a marker (api._keyword_only_signature)."""
    sdpa, explain = inspect.signature(ad.sdpa).parameters, inspect.signature(ad.explain).parameters
    assert list(sdpa.values()) == list(explain.values())
    assert [p.name for p in sdpa.values() if p.kind is p.KEYWORD_ONLY][0] == "causal"


def test_bad_input_raises_before_any_backend_runs():
    class Spy(ad.Backend):
        name = "spy"
        runs = 0

        def run(self, query, key, value, **options):
            Spy.runs += 1
            return query

    ad.register_backend(Spy(), priority="first")
    for args, kwargs, exc, _ in CASES:
        with pytest.raises(exc):
            ad.sdpa(*args, **kwargs)
    assert Spy.runs == 0


def test_mixed_nested_and_dense():
    nq = torch.nested.nested_tensor([t(3, 2, 8), t(5, 2, 8)], layout=torch.jagged).transpose(1, 2)
    with pytest.raises(TypeError, match="all be nested tensors or none of them; key is not"):
        ad.sdpa(nq, t(2, 2, 5, 8), t(2, 2, 5, 8))
    with pytest.raises(ValueError, match="must not be given with nested tensors"):
        ad.sdpa(nq, nq, nq, cu_seqlens_q=CU, cu_seqlens_k=CU)


def test_device_mismatch_message():
    meta = torch.randn(2, 4, 10, 16, device="meta")
    with pytest.raises(ValueError, match="must be on one device, got query=cpu, key=meta"):
        ad.sdpa(Q, meta, meta)
    with pytest.raises(ValueError, match="attn_mask is on meta but query is on cpu"):
        ad.sdpa(Q, K, V, attn_mask=torch.ones(8, 10, dtype=torch.bool, device="meta"))
