"""The main job on the embedded default (the CPU): a few sdpa() calls with different
features, each checked against the float64 math reference, with its decision table."""

from __future__ import annotations

import torch

from . import api, debug

_PASS_FACTOR = 2.0  # DESIGN.md section 7: at most 2x the error of torch's math in the input dtype


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _case(title, make):
    args, kwargs = make()
    out = api.sdpa(*args, **kwargs)
    decision = debug.last_decision()
    ref_args = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref_kwargs = {
        k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()
    }
    reference = api.sdpa(*ref_args, **ref_kwargs, backend="math")
    low = api.sdpa(*args, **kwargs, backend="math")  # the reference's own error in the input dtype
    err, budget = _max_err(out, reference), _max_err(low, reference)
    ok = err <= _PASS_FACTOR * budget + 1e-6 and not torch.isnan(out).any()
    print(
        f"== {title}\n   max |out - ref64| = {err:.2e} (math in {str(out.dtype)[6:]}: {budget:.2e}) "
        f"-> {'OK' if ok else 'MISMATCH'}"
    )
    print("   " + str(decision).replace("\n", "\n   "))
    return ok


def main() -> int:
    torch.manual_seed(0)
    f32 = dict(dtype=torch.float32)

    def dense_causal():
        q, k, v = (torch.randn(2, 4, 64, 32, **f32) for _ in range(3))
        return (q, k, v), dict(is_causal=True)

    def gqa_bool_mask():
        q = torch.randn(2, 8, 48, 64, **f32)
        k, v = torch.randn(2, 2, 80, 64, **f32), torch.randn(2, 2, 80, 64, **f32)
        mask = torch.rand(2, 1, 48, 80) > 0.3
        return (q, k, v), dict(attn_mask=mask, enable_gqa=True)

    def bottom_right_window():
        q, k, v = torch.randn(1, 4, 40, 64, **f32), torch.randn(1, 4, 100, 64, **f32), torch.randn(1, 4, 100, 48, **f32)
        return (q, k, v), dict(causal="bottom_right", window=(16, 0))

    def float_bias():
        q, k, v = (torch.randn(2, 4, 32, 64, **f32) for _ in range(3))
        bias = torch.randn(1, 4, 32, 32, **f32)
        return (q, k, v), dict(attn_mask=bias)

    def varlen():
        lengths = [5, 0, 33, 17]
        cu = torch.tensor([0, 5, 5, 38, 55], dtype=torch.int32)
        q, k, v = (torch.randn(sum(lengths), 4, 64, **f32) for _ in range(3))
        return (q, k, v), dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal="bottom_right")

    cases = [
        ("dense, is_causal=True (PyTorch's top-left)", dense_causal),
        ("GQA 8/2 heads, bool mask, Sq != Sk", gqa_bool_mask),
        ("bottom-right causal + sliding window (16, 0), Dv != Dqk", bottom_right_window),
        ("float bias (1, H, S, S)", float_bias),
        ("varlen: 4 packed sequences (one empty), causal", varlen),
    ]
    results = [_case(title, make) for title, make in cases]
    print(f"\n{sum(results)}/{len(results)} calls match the float64 reference")
    return 0 if all(results) else 1
