"""The triton backend's route (which of our kernels run a call) is what runs.

``explain()`` reports the route from kernels.entry.describe_route; the launches are watched
through kernels.run.launch_one (every kernel launch goes through it).  CPU: the tl kernels
under the interpreter, with the reasons the Gluon ones give.  GPU (sm90): calls on each route
(Gluon forward, dQ fused or not, tl forward with Gluon backward, tl throughout).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.kernels import is_interpreter, run  # noqa: E402
from attention_dispatch.kernels.gluon.launch import KERNELS as GLUON_KERNELS  # noqa: E402
from attention_dispatch.kernels.tl import KERNELS as TL_KERNELS  # noqa: E402

INTERP = is_interpreter()
DEV = "cpu" if INTERP else "cuda"
NAMES = {id(k): name for table in (TL_KERNELS, GLUON_KERNELS) for name, k in table.items() if k is not None}


def _watch(monkeypatch) -> list:
    """(kernel name, FUSE_DQ) of every launch from now on."""
    seen, real = [], run.launch_one

    def spy(kernel, grid, args, constexprs, *rest, **options):
        seen.append((NAMES.get(id(kernel), repr(kernel)), bool(constexprs.get("FUSE_DQ", False))))
        return real(kernel, grid, args, constexprs, *rest, **options)

    monkeypatch.setattr(run, "launch_one", spy)
    return seen


def _expected(route, seen) -> list:
    """The launches a route implies, in order (the delta pass first in every backward)."""
    steps = {s.part: s.chosen for s in route.steps}
    if steps["forward"] == "decode":  # the split pass, and the combine pass when it splits the keys
        return [("decode_split", False)] + [("decode_combine", False)] * (
            len(seen) > 1 and seen[1][0] == "decode_combine"
        )
    # "gluon" or "gluon one-length" (a causal call with Sq < Sk): the same kernel
    out = [("fwd_ws", False) if steps["forward"].startswith("gluon") else ("fwd", False)]
    if "dK/dV" not in steps:
        return out
    out.append(("bwd_preprocess", False))
    if steps["dK/dV"] == "gluon":
        out.append(("bwd_dkdv_ws", steps["dQ"] == "fused"))
    else:
        out.append(("bwd_dkdv", False))
    if steps["dQ"] == "gluon":
        out.append(("bwd_dq_ws", False))
    elif steps["dQ"] == "tl":
        out.append(("bwd_dq", False))
    return out


def _check(monkeypatch, q, k, v, mask=None, **kw):
    """explain()'s route for triton equals the kernels one forward + backward launches."""
    decision = ad.explain(q, k, v, attn_mask=mask, backend="triton", **kw)
    assert decision.backend == "triton" and decision.route is not None
    assert str(decision).startswith(f"attention_dispatch: triton [{decision.route}]")
    seen = _watch(monkeypatch)
    out = ad.sdpa(q, k, v, attn_mask=mask, backend="triton", **kw)
    if q.requires_grad:
        out.backward(torch.randn_like(out))
    assert seen == _expected(decision.route, seen), (decision.route, seen)
    return decision.route


def _qkv(B, H, S, D, dtype, grad=True, Hkv=None):
    make = lambda h: torch.randn(B, h, S, D, device=DEV, dtype=dtype, requires_grad=grad)  # noqa: E731
    return make(H), make(Hkv or H), make(Hkv or H)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_route_is_what_runs(monkeypatch, grad, causal):
    if not INTERP:
        pytest.skip("the CPU variant (interpreter)")
    route = _check(monkeypatch, *_qkv(1, 2, 40, 16, torch.float32, grad), is_causal=causal)
    assert [s.chosen for s in route.steps] == ["tl"] * (3 if grad else 1)
    assert all(alt == "gluon" and why for s in route.steps for alt, why in s.passed_over), route


@pytest.mark.parametrize(
    "shape, kw, decode",
    [
        ((1, 8, 1, 2, 600), {}, True),  # GQA 8/2, one query per sequence over 600 keys
        ((2, 4, 3, 4, 520), {"causal": "bottom_right"}, True),  # MHA, Sq=3 (speculative verify)
        ((1, 4, 2, 2, 530), {"window": (100, 0)}, True),
        ((1, 4, 2, 2, 530), {"is_causal": True}, False),  # top-left with Sq != Sk
        ((1, 8, 1, 2, 300), {}, False),  # too few keys
    ],
)
def test_cpu_decode_shaped_inference_route(monkeypatch, shape, kw, decode):
    """Inference with few query rows per kv head over many keys takes the decode kernel (bottom-right
    band), matching F.sdpa's result; the route names it, or says why not."""
    if not INTERP:
        pytest.skip("the CPU variant (interpreter)")
    B, Hq, Sq, Hkv, Sk = shape
    q = torch.randn(B, Hq, Sq, 16)
    k, v = torch.randn(B, Hkv, Sk, 16), torch.randn(B, Hkv, Sk, 16)
    route = _check(monkeypatch, q, k, v, enable_gqa=Hq != Hkv, **kw)
    assert (route.steps[0].chosen == "decode") == decode, str(route)
    if not decode:
        assert any(alt == "decode" and why for alt, why in route.steps[0].passed_over) or Sk < 512, str(route)
    out = ad.sdpa(q, k, v, backend="triton", enable_gqa=Hq != Hkv, **kw)
    ref = ad.sdpa(q.double(), k.double(), v.double(), backend="math", enable_gqa=Hq != Hkv, **kw)
    assert (out.double() - ref).abs().max() < 1e-5


def test_route_of_an_empty_call_launches_nothing(monkeypatch):
    q, k, v = _qkv(1, 2, 0, 16, torch.float32, grad=False)
    decision = ad.explain(q, k, v, backend="triton")
    assert [s.chosen for s in decision.route.steps] == ["none (nothing to compute: zeros)"]


def _sm90() -> bool:
    return not INTERP and torch.cuda.get_device_capability() == (9, 0)


# (label, (B, H, S, D), dtype, Hkv, sdpa keywords, mask maker, expected (forward, dK/dV, dQ))
GPU_CASES = [
    ("d128 4k dense", (2, 8, 4096, 128), torch.bfloat16, None, {}, None, ("gluon", "gluon", "fused")),
    ("d128 2k causal", (2, 8, 2048, 128), torch.bfloat16, None, {"is_causal": True}, None, ("gluon", "gluon", "gluon")),
    ("d64 4k dense", (2, 16, 4096, 64), torch.bfloat16, None, {}, None, ("gluon", "gluon", "fused")),
    ("d64 4k causal", (2, 16, 4096, 64), torch.bfloat16, None, {"is_causal": True}, None, ("tl", "gluon", "fused")),
    ("d128 4k GQA 8/2", (2, 8, 4096, 128), torch.float16, 2, {"enable_gqa": True}, None, ("gluon", "gluon", "fused")),
    (
        "d128 2k bias",
        (1, 8, 2048, 128),
        torch.bfloat16,
        None,
        {},
        lambda S: torch.randn(1, 8, S, S, device="cuda", dtype=torch.bfloat16),
        ("gluon", "gluon", "gluon"),
    ),
    ("d128 small", (1, 2, 256, 128), torch.bfloat16, None, {}, None, ("tl", "tl", "tl")),
    ("d256 4k", (1, 8, 4096, 256), torch.bfloat16, None, {}, None, ("gluon", "tl", "tl")),
    ("fp32", (1, 4, 1024, 64), torch.float32, None, {}, None, ("tl", "tl", "tl")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_route_is_what_runs(monkeypatch, case):
    """On an H100: the route explain() names for calls on every route is the launches' route,
    and each is the route these calls are known to take (Triton 3.6)."""
    if not _sm90():
        pytest.skip("needs an sm90 GPU")
    from attention_dispatch.kernels.gluon.route import gluon_reason

    if gluon_reason() is not None:
        pytest.skip(gluon_reason())
    label, (B, H, S, D), dtype, hkv, kw, mask, expected = case
    q, k, v = _qkv(B, H, S, D, dtype, Hkv=hkv)
    route = _check(monkeypatch, q, k, v, mask(S) if mask else None, **kw)
    assert tuple(s.chosen for s in route.steps) == expected, f"{label}: {route}"
