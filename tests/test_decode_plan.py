"""kernels/decode_plan.DecodePlan (issue 34): a repeated decode step reuses its plan, doing no
route, configuration or split choice again, allocating only its output and one workspace, and
launching the split and combine passes only; plain sdpa()'s decode route with a key length
growing by one per call keeps one plan; every result against a float64 reference written here
from the definition (sequence b attends to its first L_b keys; L_b = the whole cache when no
lengths are given).  CPU: under the interpreter; gpu: the compiled kernels relaunched directly."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.kernels import decode, decode_plan, run  # noqa: E402
from attention_dispatch.kernels.compiled_cache import COMPILED  # noqa: E402
from attention_dispatch.kernels.device import is_interpreter  # noqa: E402
from attention_dispatch.kernels.params import KernelParams  # noqa: E402
from attention_dispatch.kernels.tl import decode as tl_decode  # noqa: E402
from oracle import assert_matches  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

DEV = "cpu" if is_interpreter() else "cuda"
pytestmark = pytest.mark.skipif(
    "triton" not in ad.list_backends() or not ad.get_backend("triton").is_available(), reason="triton unavailable"
)


def reference(q, k, v, lengths):
    """float64: each (sequence, query head) over the first lengths[b] keys of its kv head."""
    b_, hq, sq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(b_, hq, sq, d, dtype=torch.float64)
    for b in range(b_):
        n = lengths[b]
        for h in range(hq):
            kk, vv = k[b, h // group, :n].double().cpu(), v[b, h // group, :n].double().cpu()
            if n:
                w = torch.softmax(q[b, h].double().cpu() @ kk.T / d**0.5, -1)
                out[b, h] = w @ vv
    return out


class Allocations(TorchDispatchMode):
    """Counts the tensors the host path creates (factory ops)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith(("empty", "zeros", "full", "new_", "ones")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _inputs(capacity=512, lengths=(300, 511)):
    b = len(lengths)
    q = torch.randn(b, 4, 1, 16, device=DEV)
    k = torch.randn(b, 1, capacity, 16, device=DEV)
    v = torch.randn(b, 1, capacity, 16, device=DEV)
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEV)


def test_a_repeated_kvcache_step_reuses_its_plan(monkeypatch):
    """Two steps through sdpa_with_kvcache() match the reference with one plan; a third one does no
    route or split choice, creates two tensors (output, workspace) and launches split + combine."""
    q, k, v, lens = _inputs()
    for step, lengths in enumerate(((300, 511), (0, 7))):
        lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q = torch.randn_like(q)
        out = ad.sdpa_with_kvcache(q, k, v, lens, backend="triton")
        assert_matches(out, reference(q, k, v, lengths), None, f"step {step}", dtype=torch.float32)
    assert len(decode_plan.PLANS) == 1
    (plan,) = decode_plan.PLANS.values()
    assert plan.last[1].combine is not None, "the case must split the keys (several splits: two launches)"

    def forbidden(*a, **kw):
        raise AssertionError("per-call work on a repeated step")

    for name in ("tiles", "key_splits", "split_constexprs", "cache_geometry", "device_info"):
        monkeypatch.setattr(decode_plan, name, forbidden)
    monkeypatch.setattr(decode, "kv_route", forbidden)
    launched = []
    monkeypatch.setattr(run, "launch_one", lambda kernel, *a, **kw: launched.append(kernel))
    with Allocations() as seen:
        ad.sdpa_with_kvcache(q, k, v, lens, backend="triton")
    assert launched == [tl_decode._decode_split, tl_decode._decode_combine]
    assert len(seen.ops) == 2, seen.ops  # the output and the one workspace
    assert len(decode_plan.PLANS) == 1


def test_an_unsplit_step_allocates_only_its_output(monkeypatch):
    q, k, v, lens = _inputs(capacity=64, lengths=(64, 3))
    ad.sdpa_with_kvcache(q, k, v, lens, backend="triton")
    launched = []
    monkeypatch.setattr(run, "launch_one", lambda kernel, *a, **kw: launched.append(kernel))
    with Allocations() as seen:
        ad.sdpa_with_kvcache(q, k, v, lens, backend="triton")
    assert launched == [tl_decode._decode_split] and len(seen.ops) == 1, (launched, seen.ops)


def test_full_length_decode_with_growing_keys_keeps_one_plan():
    """decode_forward without lengths (plain sdpa()'s decode route): every key, the cache's
    length growing by one per call, one plan for all of them."""
    params = KernelParams(scale=16**-0.5)
    q = torch.randn(2, 4, 1, 16, device=DEV)
    flat_k, flat_v = torch.randn(2 * 2 * 300 * 16, device=DEV), torch.randn(2 * 2 * 300 * 16, device=DEV)
    for sk in (255, 256, 257, 290):
        k, v = flat_k[: 2 * 2 * sk * 16].view(2, 2, sk, 16), flat_v[: 2 * 2 * sk * 16].view(2, 2, sk, 16)
        out = decode.decode_forward(q, k, v, None, params)
        assert_matches(out, reference(q, k, v, [sk, sk]), None, f"Sk={sk}", dtype=torch.float32)
    assert len(decode_plan.PLANS) == 1


def test_plans_differ_by_signature_not_by_lengths():
    q, k, v, lens = _inputs()
    ad.sdpa_with_kvcache(q, k, v, lens, backend="triton")
    ad.sdpa_with_kvcache(q, k, v, lens + 1, backend="triton")
    ad.sdpa_with_kvcache(q[:, :2], k, v, lens, backend="triton")  # 2 query heads: another signature
    assert len(decode_plan.PLANS) == 2


def _growing(sk_max, b=1, hq=4, hkv=2, d=16, dtype=torch.float32):
    """q and a function giving k, v of any key length up to sk_max as views of one buffer (what a
    growing cache hands over each step)."""
    q = torch.randn(b, hq, 1, d, device=DEV, dtype=dtype)
    flat_k = torch.randn(b * hkv * sk_max * d, device=DEV, dtype=dtype)
    flat_v = torch.randn_like(flat_k)

    def kv(sk):
        n = b * hkv * sk * d
        return flat_k[:n].view(b, hkv, sk, d), flat_v[:n].view(b, hkv, sk, d)

    return q, kv


def test_plain_decode_route_creates_no_lengths_tensor():
    """attention_forward's decode route runs full length: its tensors are the (empty) dropout
    seed, the output and the split workspace, no lengths tensor filled per call."""
    from attention_dispatch.kernels.entry import attention_forward

    q, kv = _growing(600)
    k, v = kv(600)
    with Allocations() as seen:
        out, _, _ = attention_forward(q, k, v, None, KernelParams(scale=16**-0.5), need_lse=False)
    assert not any(op.startswith(("full", "fill")) for op in seen.ops), seen.ops
    assert_matches(out, reference(q, k, v, [600]), None, "Sk=600", dtype=torch.float32)
    (plan,) = decode_plan.PLANS.values()
    assert plan.full


def test_growing_sdpa_decode_runs_the_prepared_runner(monkeypatch):
    """sdpa() with Sk growing by one per call: after the two calls that prove the span, each call
    is a span hit run by the triton backend's prepared DecodeRunner: no normalisation, decision,
    backend run() or route, no fixed launch parameter recomputed, no lengths tensor (output and
    workspace only), split + combine launched; every result against the float64 reference."""
    from attention_dispatch import api, dispatch
    from attention_dispatch.kernels import autograd, entry

    q, kv = _growing(700)
    for sk in (520, 521):  # the first marks the signature, the second proves the span
        out = ad.sdpa(q, *kv(sk), enable_gqa=True, backend="triton")
        assert_matches(out, reference(q, *kv(sk), [sk]), None, f"Sk={sk}", dtype=torch.float32)
    ((entries, _),) = dispatch.span_calls.values()
    assert isinstance(entries[0][3], decode_plan.DecodeRunner), entries

    def forbidden(*a, **kw):
        raise AssertionError("per-call work on a span hit")

    monkeypatch.setattr(api, "normalize_call", forbidden)
    monkeypatch.setattr(autograd, "triton_attention", forbidden)  # the runner's fallback: the whole path
    monkeypatch.setattr(entry, "forward_route", forbidden)
    for name in ("tiles", "split_constexprs", "combine_constexprs", "device_info"):
        monkeypatch.setattr(decode_plan, name, forbidden)
    for sk in range(522, 530):
        k, v = kv(sk)
        out = ad.sdpa(q, k, v, enable_gqa=True, backend="triton")
        assert ad.last_decision().seqlen_k_span == (512, 1023)
        assert_matches(out, reference(q, k, v, [sk]), None, f"Sk={sk}", dtype=torch.float32)
    launched = []
    with monkeypatch.context() as m:  # the host path alone (the interpreter's launches create tensors)
        m.setattr(run, "launch_one", lambda kernel, *a, **kw: launched.append(kernel))
        with Allocations() as seen:
            ad.sdpa(q, *kv(530), enable_gqa=True, backend="triton")
    assert launched == [tl_decode._decode_split, tl_decode._decode_combine], launched
    assert len(seen.ops) == 2, seen.ops  # the output and the one workspace
    assert len(decode_plan.PLANS) == 1


def test_the_runner_sends_a_call_below_the_decode_route_to_the_whole_path():
    """A prepared DecodeRunner given fewer keys than the decode route takes (a span below
    DECODE_MIN_KEYS never holds one, but the runner does not rely on it) runs the backend's path."""
    from attention_dispatch.kernels.autograd import prepare_attention
    from attention_dispatch.kernels.entry import DECODE_MIN_KEYS

    q, kv = _growing(DECODE_MIN_KEYS + 8)
    params = KernelParams(scale=16**-0.5)
    runner = prepare_attention(q, *kv(DECODE_MIN_KEYS + 8), None, params)
    assert isinstance(runner, decode_plan.DecodeRunner)
    for sk in (DECODE_MIN_KEYS - 1, DECODE_MIN_KEYS, DECODE_MIN_KEYS + 3):
        before = runner.plan.launches
        out = runner(q, *kv(sk))
        assert (runner.plan.launches > before) == (sk >= DECODE_MIN_KEYS), sk
        assert_matches(out, reference(q, *kv(sk), [sk]), None, f"Sk={sk}", dtype=torch.float32)


def test_the_combine_pass_compiles_one_variant_per_power_of_two_of_splits(monkeypatch):
    """The split count is an argument of the combine pass: key lengths giving 3 and 4 splits
    launch it with the same constexprs (one compiled kernel), 5 with the next power of two."""
    params = KernelParams(scale=16**-0.5)
    q, kv = _growing(1300)
    seen = {}
    real = run.launch_one

    def watch(kernel, grid, args, constexprs, *a, **kw):
        if kernel is tl_decode._decode_combine:
            seen[args[6]] = constexprs  # args: 5 pointers, rows, the split count
        return real(kernel, grid, args, constexprs, *a, **kw)

    monkeypatch.setattr(run, "launch_one", watch)
    for sk in (700, 1000, 1200):  # 256 keys per split at least: 3, 4 and 5 splits
        decode.decode_forward(q, *kv(sk), None, params, num_splits=-(-sk // 256))
    assert sorted(seen) == [3, 4, 5], seen
    assert seen[3] == seen[4] != seen[5]
    assert seen[4]["SPLITS_P2"] == 4 and "NUM_SPLITS" not in seen[4]


@pytest.mark.gpu
def test_gpu_growing_sdpa_decode_compiles_a_bounded_number_of_kernels():
    """A decode loop through sdpa() from Sk=512 to 2600 (2 to 11 splits) takes the decode route
    on span hits with at most a handful of compiled-kernel cache misses (the split pass by
    Triton's int classes, the combine pass by the split count's power of two), results correct."""
    from attention_dispatch import dispatch

    q, kv = _growing(2600, hq=32, hkv=8, d=128, dtype=torch.bfloat16)
    ad.sdpa(q, *kv(512), enable_gqa=True, backend="triton")
    misses = COMPILED.misses
    for sk in range(513, 2600):
        out = ad.sdpa(q, *kv(sk), enable_gqa=True, backend="triton")
        if sk % 397 == 0:
            assert_matches(out, reference(q, *kv(sk), [sk]), None, f"Sk={sk}", dtype=torch.bfloat16)
    assert COMPILED.misses - misses <= 8, COMPILED.misses - misses
    # one span per power of two (512.., 1024.., 2048..), each run by the prepared runner
    runners = [entry[3] for entries, _ in dispatch.span_calls.values() for entry in entries]
    assert len(runners) == 3 and all(isinstance(r, decode_plan.DecodeRunner) for r in runners), runners


@pytest.mark.gpu
def test_gpu_repeated_steps_relaunch_the_compiled_kernels():
    """After the first step no launch goes through the compiled-kernel cache (hits and misses
    unchanged): the plan relaunches its entries; a growing key length adds at most a few."""
    q, k, v, lens = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _inputs(4096, (4000, 17)))
    ad.sdpa_with_kvcache(q, k, v, lens, backend="triton")
    before = COMPILED.hits, COMPILED.misses
    for lengths in ((1, 4096), (2048, 0)):
        lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        out = ad.sdpa_with_kvcache(q, k, v, lens, backend="triton")
        assert_matches(out, reference(q, k, v, lengths), None, str(lengths), dtype=torch.bfloat16)
    assert (COMPILED.hits, COMPILED.misses) == before
    params = KernelParams(scale=16**-0.5)
    flat_k, flat_v = torch.randn(2 * 1 * 2100 * 16, device=DEV), torch.randn(2 * 1 * 2100 * 16, device=DEV)
    q32 = q.float()
    decode.decode_forward(
        q32, flat_k[: 2 * 1000 * 16].view(2, 1, 1000, 16), flat_v[:32000].view(2, 1, 1000, 16), None, params
    )
    misses = COMPILED.misses
    for sk in range(1001, 1100):
        k2, v2 = flat_k[: 2 * sk * 16].view(2, 1, sk, 16), flat_v[: 2 * sk * 16].view(2, 1, sk, 16)
        out = decode.decode_forward(q32, k2, v2, None, params)
        if sk % 33 == 0:
            assert_matches(out, reference(q32, k2, v2, [sk, sk]), None, f"Sk={sk}", dtype=torch.float32)
    assert COMPILED.misses - misses <= 4, "one specialisation class per split count and divisibility"


@pytest.mark.parametrize(
    "programs, capacity, equal_lengths, splits",
    [
        (256, 32768, False, 10),  # MHA B=8 Sk=32k: 2560 programs, not the 768 that ran at 0.83 of F.sdpa (E138)
        (512, 32768, False, 5),  # GQA B=64 uniform 1..32k: long sequences spread
        (2048, 4096, False, 1),  # already ~16 programs an SM
        (8, 131072, False, decode_plan.MAX_DECODE_SPLITS),  # B=1 GQA over 128k: capped
        (64, 1024, False, 4),  # every split at least MIN_KEYS_PER_SPLIT keys
        (256, 32768, True, 2),  # every sequence the whole cache: about four programs an SM (E138)
        (64, 32768, True, 8),
        (512, 4096, True, 1),
        (8, 131072, True, decode_plan.MAX_DECODE_SPLITS),
    ],
)
def test_decode_splits_on_132_sms(programs, capacity, equal_lengths, splits):
    assert decode_plan.decode_splits(programs, capacity, 132, equal_lengths) == splits


def test_decode_splits_under_the_interpreter_still_split_small_grids():
    assert decode_plan.decode_splits(3, 512, 1) == 2  # uneven lengths round the four "waves" up
    assert decode_plan.decode_splits(3, 512, 1, equal_lengths=True) == 1
    assert decode_plan.decode_splits(1, 4096, 1, equal_lengths=True) == 4


def test_the_most_splits_with_mostly_empty_ones_match_the_reference():
    """MAX_DECODE_SPLITS splits of one key tile each over per-sequence lengths from 0 to the whole
    cache (E138's rule gives short sequences many splits past their length): the empty splits'
    partials drop out of the merge."""
    splits = decode_plan.MAX_DECODE_SPLITS
    block_n = decode_plan.tiles(4, 1, 16)[1]
    lengths = (0, 5, splits * block_n, 1000 % (splits * block_n))
    q, k, v, lens = _inputs(capacity=splits * block_n, lengths=lengths)
    out = decode.decode_forward(q, k, v, lens, KernelParams(scale=16**-0.5), num_splits=splits)
    assert_matches(out, reference(q, k, v, lengths), None, f"{splits} splits", dtype=torch.float32)


def test_decode_splits_hold_the_workspace_to_its_bound():
    """Many rows a program (Sq > 1, large head dims) take fewer splits than the grid target asks,
    so that the float32 partials stay within MAX_SPLIT_WORKSPACE."""
    split_bytes = 40 * 64 * (512 + 1) * 4  # 40 programs of 64 rows at d512
    splits = decode_plan.decode_splits(40, 1 << 17, 132, split_bytes=split_bytes)
    assert splits == decode_plan.MAX_SPLIT_WORKSPACE // split_bytes < 2640 // 40
    assert splits * split_bytes <= decode_plan.MAX_SPLIT_WORKSPACE
    assert decode_plan.decode_splits(40, 1 << 17, 132, split_bytes=1 << 30) == 1  # never below one


def test_a_plan_passes_its_split_workspace_to_the_bound(monkeypatch):
    """DecodePlan hands decode_splits one split's workspace (each row's partial output and logsumexp):
    with the bound at exactly one split's bytes, the call that splits in two runs unsplit, and
    still matches the reference."""
    q, k, v, lens = _inputs()
    b, hq, sq, d = q.shape
    block_d = decode_plan.tiles(hq // k.shape[1], sq, d)[2]
    monkeypatch.setattr(decode_plan, "MAX_SPLIT_WORKSPACE", b * hq * sq * (block_d + 1) * 4)
    out = decode.decode_forward(q, k, v, lens, KernelParams(scale=d**-0.5))
    (plan,) = decode_plan.PLANS.values()
    assert plan.last[1].combine is None, "one split: no combine pass"
    assert_matches(out, reference(q, k, v, lens.tolist()), None, "bounded workspace", dtype=torch.float32)
    monkeypatch.setattr(decode_plan, "MAX_SPLIT_WORKSPACE", 2 * b * hq * sq * (block_d + 1) * 4)
    decode_plan.PLANS.clear()
    decode.decode_forward(q, k, v, lens, KernelParams(scale=d**-0.5))
    (plan,) = decode_plan.PLANS.values()
    assert plan.last[1].combine is not None and plan.last[1].ws_numel * 4 <= decode_plan.MAX_SPLIT_WORKSPACE
