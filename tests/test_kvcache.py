"""sdpa_with_kvcache(): every backend that declares a KV-cache path against an independent
float64 reference written here from the definition (one sequence at a time), the append's
effect on the cache, every bad input's message, explain_with_kvcache(), the decision cache
over a decode loop, and (gpu) CUDA-graph capture and replay.

The definition: sequence b attends to its first L_b = cache_seqlens[b] (+ Sq with k_new) keys
(a paged cache holds key j of sequence b in block block_table[b, j // block_size], row
j % block_size); causal=True allows key j for query i when j <= i + L_b - Sq; window (left,
right) allows L_b - Sq + i - left <= j <= L_b - Sq + i + right; L_b = 0 gives 0.  k_new/v_new
are first written at positions cache_seqlens[b] ... of sequence b.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import dispatch
from cases import restrided
from oracle import assert_matches


@dataclasses.dataclass(frozen=True)
class KvCase:
    dtype: torch.dtype = torch.float32
    batch: int = 3
    heads_q: int = 4
    heads_kv: int = 2
    seqlen_q: int = 1
    capacity: int = 64  # dense S_cache; paged max_blocks * block_size
    head_dim: int = 16
    block_size: int | None = None  # None: a dense cache
    append: bool = False  # k_new/v_new
    causal: bool = False
    window: tuple[int, int] | None = None
    # cached keys per sequence before k_new; None: the first full, the second empty, the rest random
    lengths: tuple[int, ...] | None = None
    softcap: float | None = None
    alibi: bool = False  # ALiBi slopes (Hq,)
    sinks: bool = False
    return_lse: bool = False
    # memory layouts (cases.LAYOUTS) of query, k_cache, v_cache, k_new, v_new; () all contiguous
    layouts: tuple[str, ...] = ()

    def __str__(self):
        fields = [
            f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if getattr(self, f.name) != f.default
        ]
        return ",".join(fields) or "default"


# ---- the reference -------------------------------------------------------------------------


def reference_keys(cache, b: int, length: int, block_table) -> torch.Tensor:
    """Keys (or values) 0 .. length-1 of sequence b as (Hkv, length, D), one key at a time."""
    if block_table is None:
        return cache[b, :, :length]
    page = cache.shape[1]
    rows = [cache[int(block_table[b, j // page]), j % page] for j in range(length)]
    if not rows:
        return cache.new_zeros(cache.shape[2], 0, cache.shape[3])
    return torch.stack(rows, dim=1)


def reference_append(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table):
    """Copies of the caches with k_new/v_new (B, Hkv, Sq, D) written at cache_seqlens[b] + i."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(cache_seqlens.tolist()):
        for i in range(k_new.shape[2]):
            j = start + i
            if block_table is None:
                k_cache[b, :, j], v_cache[b, :, j] = k_new[b, :, i], v_new[b, :, i]
            else:
                page = k_cache.shape[1]
                blk = int(block_table[b, j // page])
                k_cache[blk, j % page], v_cache[blk, j % page] = k_new[b, :, i], v_new[b, :, i]
    return k_cache, v_cache


def kv_reference(
    query,
    k_cache,
    v_cache,
    lengths,
    *,
    block_table=None,
    causal=False,
    window=None,
    dtype=torch.float64,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
):
    """The output (and with return_lse the rows' logsumexp, without the sinks) of the definition
    in ``dtype`` (float64: the oracle; the input dtype: the budget), the cache already holding the
    appended keys; lengths: L_b per sequence."""
    b_, hq, sq, d = query.shape
    scale = 1.0 / math.sqrt(d)
    out = torch.zeros(b_, hq, sq, d, dtype=dtype)
    lse = torch.full((b_, hq, sq), -math.inf, dtype=dtype)
    for b in range(b_):
        n = lengths[b]
        k = reference_keys(k_cache, b, n, block_table).to(dtype)
        v = reference_keys(v_cache, b, n, block_table).to(dtype)
        group = hq // k.shape[0]
        i = torch.arange(sq)[:, None]
        j = torch.arange(n)[None, :]
        diag = i + n - sq
        ok = torch.ones(sq, n, dtype=torch.bool)
        if causal:
            ok &= j <= diag
        if window is not None:
            left, right = window
            if left >= 0:
                ok &= j >= diag - left
            if right >= 0:
                ok &= j <= diag + right
        for h in range(hq):
            scores = (query[b, h].to(dtype) @ k[h // group].T) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if alibi_slopes is not None:
                scores = scores - float(alibi_slopes[h]) * (diag - j).abs().to(dtype)
            scores = scores.masked_fill(~ok, -math.inf)
            if sinks is not None:  # one more logit that carries no value
                sink = torch.full((sq, 1), float(sinks[h]), dtype=dtype)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[:, :n]
            else:
                probs = torch.softmax(scores, dim=-1)
            probs = torch.where(ok.any(-1, keepdim=True), probs, torch.zeros((), dtype=dtype))
            out[b, h] = probs @ v[h // group]
            lse[b, h] = torch.where(ok.any(-1), torch.logsumexp(scores, dim=-1), -math.inf)
    return (out, lse) if return_lse else out


# ---- inputs and the check ------------------------------------------------------------------


def make_kv_inputs(case: KvCase, device="cpu"):
    """Fresh random tensors for `case`: a dict of sdpa_with_kvcache()'s arguments."""
    kw = dict(dtype=case.dtype, device=device)
    b, hkv, d = case.batch, case.heads_kv, case.head_dim
    query = torch.randn(b, case.heads_q, case.seqlen_q, d, **kw)
    block_table = None
    if case.block_size is None:
        k_cache = torch.randn(b, hkv, case.capacity, d, **kw)
    else:
        per_seq = case.capacity // case.block_size
        num_blocks = b * per_seq + 3  # a few blocks no sequence uses
        k_cache = torch.randn(num_blocks, case.block_size, hkv, d, **kw)
        perm = torch.randperm(num_blocks)[: b * per_seq]
        block_table = perm.reshape(b, per_seq).to(torch.int32).to(device)
    v_cache = torch.randn_like(k_cache)
    n_new = case.seqlen_q if case.append else 0
    if case.lengths is not None:
        lengths = list(case.lengths)
    else:
        room = case.capacity - n_new
        lengths = [room, 0] + torch.randint(0, room + 1, (max(0, b - 2),)).tolist()
        lengths = lengths[:b]
    args = dict(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=block_table,
        causal=case.causal,
        window=case.window,
    )
    if case.append:
        args["k_new"] = torch.randn(b, hkv, case.seqlen_q, d, **kw)
        args["v_new"] = torch.randn(b, hkv, case.seqlen_q, d, **kw)
    if case.softcap is not None:
        args["softcap"] = case.softcap
    if case.alibi:
        args["alibi_slopes"] = torch.rand(case.heads_q, device=device) * 0.3 + 0.05
    if case.sinks:
        args["sinks"] = torch.randn(case.heads_q, device=device, dtype=case.dtype) + 2.0
    if case.return_lse:
        args["return_lse"] = True
    for name, layout in zip(("query", "k_cache", "v_cache", "k_new", "v_new"), case.layouts):
        if name in args:
            args[name] = restrided(args[name], layout)
    return args


def same_values(a, b) -> bool:
    """Equal element for element, NaN equal to NaN (a cache may hold NaN past its lengths)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_kv_call(backend: str, case: KvCase, device="cpu", args=None):
    """sdpa_with_kvcache(backend=...) on fresh inputs (or `args`, make_kv_inputs()'s) against the
    reference: the output (2x the reference's own error in the input dtype, plus slack; never
    NaN), the cache after the append (exactly), cache_seqlens unchanged.  Returns the output."""
    args = make_kv_inputs(case, device) if args is None else args
    seqlens0 = args["cache_seqlens"].clone()
    k0, v0 = args["k_cache"].cpu().clone(), args["v_cache"].cpu().clone()
    out = ad.sdpa_with_kvcache(**args, backend=backend)
    out, lse = out if case.return_lse else (out, None)
    assert ad.last_decision().backend == backend
    assert out.dtype == case.dtype and out.device == args["query"].device
    assert torch.equal(args["cache_seqlens"], seqlens0), "cache_seqlens was modified"
    table = None if args["block_table"] is None else args["block_table"].cpu()
    if case.append:
        k_want, v_want = reference_append(k0, v0, seqlens0.cpu(), args["k_new"].cpu(), args["v_new"].cpu(), table)
    else:
        k_want, v_want = k0, v0
    assert same_values(args["k_cache"].cpu(), k_want), f"{backend} {case}: k_cache after the call"
    assert same_values(args["v_cache"].cpu(), v_want), f"{backend} {case}: v_cache after the call"
    lengths = [n + (case.seqlen_q if case.append else 0) for n in seqlens0.tolist()]
    common = dict(block_table=table, causal=case.causal, window=case.window, softcap=case.softcap)
    for name in ("alibi_slopes", "sinks"):
        if name in args:
            common[name] = args[name].cpu()
    q = args["query"].cpu()
    ref64, lse64 = kv_reference(q, k_want, v_want, lengths, return_lse=True, **common)
    ref_low, lse_low = kv_reference(q, k_want, v_want, lengths, dtype=case.dtype, return_lse=True, **common)
    assert_matches(out.cpu(), ref64, ref_low, f"{backend} {case} out", dtype=case.dtype)
    if lse is not None:
        want = torch.float64 if case.dtype == torch.float64 else torch.float32
        assert lse.dtype == want and lse.shape == out.shape[:-1], f"lse {lse.dtype} {tuple(lse.shape)}"
        assert_matches(lse.cpu(), lse64, lse_low, f"{backend} {case} lse", dtype=case.dtype)
    return out


# ---- every backend against the reference ---------------------------------------------------

CASES = {
    "dense decode MHA": KvCase(heads_kv=4),
    "dense decode GQA append": KvCase(append=True),
    "dense MQA append Sq=3 causal": KvCase(heads_q=4, heads_kv=1, seqlen_q=3, append=True, causal=True),
    "dense Sq=4 causal, no append": KvCase(seqlen_q=4, causal=True, lengths=(64, 2, 30)),
    "dense window": KvCase(seqlen_q=2, window=(3, 1), append=True),
    "dense window left + causal": KvCase(seqlen_q=3, window=(5, -1), causal=True),
    "dense long cache, split-KV": KvCase(batch=2, heads_kv=1, capacity=576, append=True, lengths=(575, 300)),
    "paged bs16 append GQA": KvCase(block_size=16, append=True),
    "paged bs32 causal Sq=2": KvCase(block_size=32, seqlen_q=2, causal=True, append=True),
    "paged bs64 window": KvCase(block_size=64, seqlen_q=2, window=(7, 0), lengths=(64, 0, 40)),
    "paged bs16 MHA Sq=3": KvCase(block_size=16, heads_kv=4, seqlen_q=3, causal=True, lengths=(61, 1, 17)),
    "empty caches": KvCase(lengths=(0, 0, 0)),
    # nothing to compute: an empty output of the right shape (the split plan divides by the rows)
    "no query rows": KvCase(seqlen_q=0, lengths=(5, 0, 64)),
    "no query rows, append of none, lse": KvCase(seqlen_q=0, append=True, return_lse=True),
    "no query rows paged": KvCase(seqlen_q=0, block_size=16),
    "empty batch": KvCase(batch=0, append=True, causal=True, seqlen_q=2),
    "empty batch paged": KvCase(batch=0, block_size=16),
    "empty paged caches": KvCase(block_size=16, seqlen_q=2, causal=True, lengths=(0, 0, 0)),
    "full caches": KvCase(seqlen_q=2, append=True, causal=True, lengths=(62, 62, 62)),
    "full paged caches": KvCase(block_size=32, lengths=(64, 64, 64)),
    "float16 dense": KvCase(dtype=torch.float16, seqlen_q=2, append=True, causal=True),
    "bfloat16 dense": KvCase(dtype=torch.bfloat16, window=(4, 0)),
    "float16 paged": KvCase(dtype=torch.float16, block_size=16, append=True),
    "bfloat16 paged": KvCase(dtype=torch.bfloat16, block_size=32, seqlen_q=3, causal=True, append=True),
    "float64 dense": KvCase(dtype=torch.float64, seqlen_q=2, append=True, causal=True),
    "float64 paged": KvCase(dtype=torch.float64, block_size=16, append=True),
    "head_dim 40": KvCase(head_dim=40, append=True),
    "head_dim 8 paged": KvCase(head_dim=8, block_size=16, seqlen_q=2, causal=True, append=True),
    # 72 query rows per kv head: two row blocks of the decode kernel, one of which writes the append
    "append, two row blocks": KvCase(heads_q=8, heads_kv=1, seqlen_q=9, append=True, causal=True, lengths=(55, 0, 20)),
    "paged append, two row blocks": KvCase(heads_q=8, heads_kv=1, seqlen_q=9, block_size=16, append=True),
    # Sq past one row block (64 rows): the first row block's queries see only part of the new keys
    # through causal or a right window, yet all of them must reach the cache
    "append Sq=80 causal, new keys past the first row block": KvCase(
        batch=2, heads_q=1, heads_kv=1, seqlen_q=80, capacity=160, append=True, causal=True, lengths=(50, 0)
    ),
    "paged append Sq=80 window, new keys past the first row block": KvCase(
        batch=2,
        heads_q=2,
        heads_kv=1,
        seqlen_q=80,
        capacity=160,
        block_size=16,
        append=True,
        window=(20, 0),
        lengths=(80, 3),
    ),
}


def _declared(backend: str, case: KvCase) -> bool:
    """Whether `backend` declares what `case` needs (the test then requires it to be chosen)."""
    caps = ad.get_backend(backend).capabilities
    if case.dtype not in caps.dtypes or (case.window is not None and not caps.window):
        return False
    if case.heads_q != case.heads_kv and not caps.gqa:
        return False
    features = {
        "softcap": case.softcap is not None,
        "alibi": case.alibi,
        "sinks": case.sinks,
        "return_lse": case.return_lse,
    }
    if any(used and not getattr(caps, name) for name, used in features.items()):
        return False
    if case.block_size is not None:
        return "paged" in caps.kv_cache and caps.paged_block_size_ok(case.block_size)
    return "dense" in caps.kv_cache


@pytest.mark.parametrize("backend", ["math", "triton", "torch_cpu"])
@pytest.mark.parametrize("label", list(CASES))
def test_backend_matches_the_reference(backend, label):
    case = CASES[label]
    if not ad.get_backend(backend).is_available():
        pytest.skip(f"{backend}: {ad.get_backend(backend).unavailable_reason()}")
    if not _declared(backend, case):
        pytest.skip(f"{backend} does not declare {label}")
    check_kv_call(backend, case)


def test_the_reference_follows_the_definition():
    """The reference itself, by hand: one sequence, two cached keys, one query."""
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[0.0, 0.0], [2.0, 0.0], [9.0, 9.0]]]])
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [7.0, 7.0]]]])
    out = kv_reference(q, k, v, [2])
    w = torch.softmax(torch.tensor([0.0, 2.0 / math.sqrt(2)], dtype=torch.float64), 0)
    want = w[0] * torch.tensor([1.0, 2.0], dtype=torch.float64) + w[1] * torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert torch.allclose(out[0, 0, 0], want)
    assert kv_reference(q, k, v, [0]).abs().max() == 0
    # causal with Sq=2 against L=2: the first query sees key 0 only
    q2 = torch.randn(1, 1, 2, 2)
    out = kv_reference(q2, k, v, [2], causal=True)
    assert torch.allclose(out[0, 0, 0], v[0, 0, 0].double())


def test_unused_block_table_entries_are_never_read():
    """Entries past the blocks a sequence reads may hold anything (-1 here), as in serving engines."""
    case = KvCase(block_size=16, append=True, lengths=(10, 0, 20))
    args = make_kv_inputs(case)
    needed = [-(-(n + 1) // 16) for n in case.lengths]
    for b, n in enumerate(needed):
        args["block_table"][b, n:] = -1
    for backend in ("math", "triton"):
        call = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
        out = ad.sdpa_with_kvcache(**call, backend=backend)
        k, v = reference_append(
            args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"], args["v_new"], args["block_table"]
        )
        ref = kv_reference(args["query"], k, v, [n + 1 for n in case.lengths], block_table=args["block_table"])
        assert_matches(out, ref, None, backend, dtype=torch.float32)


@pytest.mark.parametrize("bad", [-3, 1000])
def test_block_entries_out_of_range_are_never_read_or_written_by_the_triton_kernel(bad):
    """validate=False with an entry outside [0, num_blocks) (an input error validate=True reports): the
    decode kernel skips that block's keys, reading and writing nothing outside the cache (as append_kv),
    and the other sequences' outputs and appended rows are exact.  The caches are slices of larger
    buffers whose surroundings must stay untouched."""
    case = KvCase(block_size=16, append=True, seqlen_q=3, lengths=(20, 9, 30))
    args = make_kv_inputs(case)
    b_bad = 1  # sequence 1 reads block 0 only; its appended rows 9..11 land there
    args["block_table"][b_bad, 0] = bad
    whole = {name: torch.randn(args[name].shape[0] + 4, *args[name].shape[1:]) for name in ("k_cache", "v_cache")}
    for name in whole:
        whole[name][2:-2] = args[name]
    before = {name: t.clone() for name, t in whole.items()}
    call = {**args, "k_cache": whole["k_cache"][2:-2], "v_cache": whole["v_cache"][2:-2]}
    out = ad.sdpa_with_kvcache(**call, backend="triton", validate=False)
    assert not out.isnan().any()
    for name in whole:  # outside the cache: untouched
        assert same_values(whole[name][:2], before[name][:2]) and same_values(whole[name][-2:], before[name][-2:])
    good = [b for b in range(case.batch) if b != b_bad]
    table = args["block_table"][good]
    k, v = reference_append(
        args["k_cache"], args["v_cache"], args["cache_seqlens"][good], args["k_new"][good], args["v_new"][good], table
    )
    assert same_values(call["k_cache"], k) and same_values(call["v_cache"], v)
    ref = kv_reference(args["query"][good], k, v, [case.lengths[b] + 3 for b in good], block_table=table)
    assert_matches(out[good], ref, None, "the valid sequences", dtype=torch.float32)


def test_a_paged_cache_without_blocks_reads_nothing():
    """validate=False, a paged cache of 0 blocks and lengths past 0 (an input error validate=True reports): no
    block entry is in range, so no key is read (the kernel once read block 0 of the empty cache): zeros."""
    case = KvCase(block_size=16, append=True, lengths=(5, 0, 9))
    args = make_kv_inputs(case)
    args["k_cache"], args["v_cache"] = args["k_cache"][:0], args["v_cache"][:0]
    out = ad.sdpa_with_kvcache(**args, backend="triton", validate=False)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("backend", ["math", "triton", "torch_cpu"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize(
    "k_layout,v_layout",
    [("tokens_first", "contiguous"), ("contiguous", "every_other"), ("tokens_first", "padded_rows")],
)
def test_new_keys_and_values_in_layouts_of_their_own(backend, paged, k_layout, v_layout):
    """k_new and v_new each in any layout, the two different (the decode kernel once read v_new with k_new's
    strides: a wrong cache and output, silently); the repeated call too (the prepared runner)."""
    layouts = ("contiguous", "contiguous", "contiguous", k_layout, v_layout)
    case = KvCase(
        seqlen_q=3, append=True, causal=True, block_size=16 if paged else None, lengths=(5, 0, 40), layouts=layouts
    )
    if not _declared(backend, case):
        pytest.skip(f"{backend} does not declare {case}")
    for _ in range(2):
        check_kv_call(backend, case)


def test_inputs_that_require_grad_give_an_output_without_graph():
    case = KvCase(append=True)
    args = make_kv_inputs(case)
    for name in ("query", "k_cache", "v_cache", "k_new", "v_new"):
        args[name].requires_grad_(True)
    out = ad.sdpa_with_kvcache(**args, backend="math")
    assert not out.requires_grad and out.grad_fn is None


def test_one_int_cache_seqlens_for_every_sequence():
    """flash-attn's form: cache_seqlens an int."""
    args = make_kv_inputs(KvCase(append=True))
    args["cache_seqlens"] = 5
    k, v = args["k_cache"].clone(), args["v_cache"].clone()
    out = ad.sdpa_with_kvcache(**args, backend="math")
    seqlens = torch.full((3,), 5, dtype=torch.int32)
    k, v = reference_append(k, v, seqlens, args["k_new"], args["v_new"], None)
    assert torch.equal(args["k_cache"], k)
    assert_matches(out, kv_reference(args["query"], k, v, [6, 6, 6]), None, "int cache_seqlens", dtype=torch.float32)


# ---- bad inputs ----------------------------------------------------------------------------


def _base_args(paged=False, append=True):
    case = KvCase(batch=2, seqlen_q=2, capacity=48, block_size=16 if paged else None, append=append, lengths=(3, 4))
    return make_kv_inputs(case)


def _set(**changes):
    def change(args):
        args.update(changes)

    return change


def _on(name, fn):
    def change(args):
        args[name] = fn(args[name])

    return change


def _entry(name, index, value):
    def change(args):
        args[name][index] = value

    return change


BAD = [
    # (label, paged, change, exception, message)
    (
        "query int",
        False,
        _on("query", lambda t: t.int()),
        TypeError,
        r"query.dtype=int32 is not allowed; allowed: float16",
    ),
    (
        "query 3-D",
        False,
        _on("query", lambda t: t[0]),
        ValueError,
        r"query must be \(B, Hq, Sq, D\), got shape \(4, 2, 16\)",
    ),
    (
        "query not a tensor",
        False,
        _on("query", lambda t: t.tolist()),
        TypeError,
        r"query must be a torch.Tensor, got list",
    ),
    (
        "k_cache dtype",
        False,
        _on("k_cache", lambda t: t.half()),
        ValueError,
        r"k_cache.dtype=float16 but query.dtype=float32; they must match",
    ),
    (
        "v_cache dtype",
        False,
        _on("v_cache", lambda t: t.double()),
        ValueError,
        r"v_cache.dtype=float64 but query.dtype=float32",
    ),
    (
        "k_cache device",
        False,
        _on("k_cache", lambda t: t.to("meta")),
        ValueError,
        r"k_cache is on meta but query is on cpu",
    ),
    (
        "k_cache 3-D",
        False,
        _on("k_cache", lambda t: t[0]),
        ValueError,
        r"k_cache must be 4-D: dense \(B, Hkv, S_cache, D\), or paged .* got shape \(2, 48, 16\)",
    ),
    (
        "v_cache shape",
        False,
        _on("v_cache", lambda t: t[:, :, :40]),
        ValueError,
        r"v_cache has shape \(2, 2, 40, 16\) but k_cache \(2, 2, 48, 16\); both must be \(B, Hkv, S_cache, D\)",
    ),
    (
        "cache batch",
        False,
        lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]),
        ValueError,
        r"k_cache has batch 1 but query has 2",
    ),
    (
        "head dims",
        False,
        lambda a: a.update(k_cache=a["k_cache"][..., :8], v_cache=a["v_cache"][..., :8]),
        ValueError,
        r"k_cache has head_dim 8 but query has 16",
    ),
    (
        "cache_seqlens int64",
        False,
        _on("cache_seqlens", lambda t: t.long()),
        TypeError,
        r"cache_seqlens.dtype=int64 is not allowed; allowed: int32 \(B,\)",
    ),
    (
        "cache_seqlens list",
        False,
        _on("cache_seqlens", lambda t: t.tolist()),
        TypeError,
        r"cache_seqlens must be an int32 tensor \(B,\), got list",
    ),
    (
        "cache_seqlens shape",
        False,
        _on("cache_seqlens", lambda t: torch.cat([t, t])),
        ValueError,
        r"cache_seqlens must be \(B,\) with B=2, got shape \(4,\)",
    ),
    (
        "cache_seqlens device",
        False,
        _on("cache_seqlens", lambda t: t.to("meta")),
        ValueError,
        r"cache_seqlens is on meta but query is on cpu",
    ),
    ("cache_seqlens negative", False, _entry("cache_seqlens", 1, -1), ValueError, r"cache_seqlens\[1\]=-1 is negative"),
    (
        "cache_seqlens past capacity",
        False,
        lambda a: (a.update(k_new=None, v_new=None), a["cache_seqlens"].__setitem__(1, 49)),
        ValueError,
        r"cache_seqlens\[1\]=49 exceeds the cache's capacity 48 \(k_cache.shape\[2\]\)",
    ),
    (
        "cache_seqlens + k_new past capacity",
        False,
        _entry("cache_seqlens", 0, 47),
        ValueError,
        r"cache_seqlens\[0\]=47 \+ 2 new keys \(k_new\) = 49 exceeds the cache's capacity 48",
    ),
    (
        "int cache_seqlens past capacity",
        False,
        _set(cache_seqlens=47),
        ValueError,
        r"cache_seqlens=47 \+ 2 new keys \(k_new\) is outside the cache's capacity \[0, 48\]",
    ),
    (
        "paged past capacity",
        True,
        _entry("cache_seqlens", 1, 47),
        ValueError,
        r"cache_seqlens\[1\]=47 \+ 2 new keys \(k_new\) = 49 exceeds the cache's capacity 48 \(block_table.shape\[1\] \* block_size = 3 \* 16\)",
    ),
    (
        "block_table int64",
        True,
        _on("block_table", lambda t: t.long()),
        TypeError,
        r"block_table.dtype=int64 is not allowed; allowed: int32 \(B, max_blocks\)",
    ),
    (
        "block_table 1-D",
        True,
        _on("block_table", lambda t: t.reshape(-1)),
        ValueError,
        r"block_table must be \(B, max_blocks\) with B=2, got shape \(6,\)",
    ),
    (
        "block_table device",
        True,
        _on("block_table", lambda t: t.to("meta")),
        ValueError,
        r"block_table is on meta but query is on cpu",
    ),
    (
        "block_table entry too large",
        True,
        _entry("block_table", (1, 0), 9),
        ValueError,
        r"block_table\[1, 0\]=9 is out of range \[0, 9\) \(num_blocks = k_cache.shape\[0\]; sequence 1 reads its first 1 blocks\)",
    ),
    (
        "block_table entry negative",
        True,
        _entry("block_table", (0, 0), -1),
        ValueError,
        r"block_table\[0, 0\]=-1 is out of range \[0, 9\)",
    ),
    (
        "paged cache shapes differ",
        True,
        _on("v_cache", lambda t: t[:, :8]),
        ValueError,
        r"v_cache has shape \(9, 8, 2, 16\) but k_cache \(9, 16, 2, 16\); both must be \(num_blocks, block_size, Hkv, D\)",
    ),
    (
        "block_size 0",
        True,
        lambda a: a.update(k_cache=a["k_cache"][:, :0], v_cache=a["v_cache"][:, :0]),
        ValueError,
        r"k_cache has block_size=0: a paged cache is .* with block_size >= 1",
    ),
    (
        "k_new without v_new",
        False,
        _set(v_new=None),
        ValueError,
        r"k_new given without v_new: pass both, \(B, Hkv, Sq, D\), or neither",
    ),
    ("v_new without k_new", False, _set(k_new=None), ValueError, r"v_new given without k_new"),
    (
        "k_new shape",
        False,
        _on("k_new", lambda t: t[:, :, :1]),
        ValueError,
        r"k_new must be \(B, Hkv, Sq, D\) = \(2, 2, 2, 16\) .*got shape \(2, 2, 1, 16\)",
    ),
    (
        "v_new dtype",
        False,
        _on("v_new", lambda t: t.half()),
        ValueError,
        r"v_new.dtype=float16 but query.dtype=float32",
    ),
    (
        "heads not a multiple",
        False,
        _on("query", lambda t: t[:, :3]),
        ValueError,
        r"query has 3 heads, not a multiple of the cache's key/value heads \(2\)",
    ),
    (
        "gqa without enable_gqa",
        False,
        _set(enable_gqa=False),
        ValueError,
        r"query has 4 heads but the cache has 2; pass enable_gqa=True",
    ),
    ("enable_gqa not a bool", False, _set(enable_gqa=1), TypeError, r"enable_gqa must be a bool, got int"),
    (
        "causal top_left",
        False,
        _set(causal="top_left"),
        ValueError,
        r"causal='top_left' is not allowed with a KV cache: .*pass causal=True",
    ),
    (
        "causal unknown",
        False,
        _set(causal="sideways"),
        ValueError,
        r"causal='sideways' is not allowed; allowed: True, False \(or 'bottom_right', the same as True\)",
    ),
    ("causal not a bool", False, _set(causal=1.5), TypeError, r"causal=1.5 is not allowed; allowed: True, False"),
    (
        "window negative",
        False,
        _set(window=(-2, 0)),
        ValueError,
        r"window left=-2 is negative; allowed: >= 0, or -1 for unbounded",
    ),
    (
        "window not a pair",
        False,
        _set(window=3),
        TypeError,
        r"window must be None or a \(left, right\) pair of ints, got 3",
    ),
    ("scale not finite", False, _set(scale=math.inf), ValueError, r"scale must be None or a finite float, got inf"),
    ("validate not a bool", False, _set(validate="yes"), TypeError, r"validate must be None, True or False, got str"),
]


@pytest.mark.parametrize("label,paged,change,exc,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_any_kernel(label, paged, change, exc, message):
    args = _base_args(paged)
    change(args)
    before = [t.clone() for t in (args["k_cache"], args["v_cache"]) if t.device.type == "cpu"]
    with pytest.raises(exc, match=message):
        ad.sdpa_with_kvcache(**args, backend="math")
    after = [t for t in (args["k_cache"], args["v_cache"]) if t.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the cache changed before the error"
    with pytest.raises(exc, match=message):
        ad.explain_with_kvcache(**args)


def test_validate_false_never_reads_the_values():
    """validate=False: out-of-range values are not looked at (explain runs nothing, so this is safe)."""
    args = _base_args(paged=True)
    args["cache_seqlens"][0] = 47
    args["block_table"][1, 0] = 99
    with pytest.raises(ValueError, match="exceeds the cache's capacity"):
        ad.explain_with_kvcache(**args)
    assert ad.explain_with_kvcache(**args, validate=False).backend is not None


# ---- explain, record, the decision cache ---------------------------------------------------


def test_explain_names_the_chosen_backend_and_why_not_the_others():
    args = _base_args(paged=True)
    k0 = args["k_cache"].clone()
    d = ad.explain_with_kvcache(**args)
    assert torch.equal(args["k_cache"], k0), "explain wrote into the cache"
    assert d.backend == "triton" and d.problem.layout == "paged" and d.problem.kv_block_size == 16
    assert d.problem.kv_append and d.problem.seqlen_k == 48
    assert d.rejected["torch_cpu"] == ["paged KV cache not supported (only dense)"]
    assert any("not supported" in r or "not installed" in r for r in d.rejected["flash_attn"])
    text = str(d)
    assert "paged B=2 Hq=4 Hkv=2 Sq=2 cache=48" in text and "block_size=16" in text and "append" in text
    # block size 8: not a power of two >= 16 for the kernel; math serves it
    small = make_kv_inputs(KvCase(block_size=8, capacity=48))
    d = ad.explain_with_kvcache(**small)
    assert d.backend == "math"
    assert "paged block_size=8 not supported (allowed: powers of two >= 16)" in d.rejected["triton"]
    # float64: the kernel's dtypes; the dense torch path serves it
    d = ad.explain_with_kvcache(**make_kv_inputs(KvCase(dtype=torch.float64)))
    assert d.backend == "torch_cpu" and any("dtype=float64" in r for r in d.rejected["triton"])
    # backends without a KV-cache path say so; their check(), written for sdpa()'s layouts, is not asked
    flash, problem = ad.get_backend("torch_flash"), d.problem
    assert "KV-cache calls (sdpa_with_kvcache) not supported" in flash.reasons(problem)
    assert flash.reasons(problem) == ad.not_supported_reasons(flash.capabilities, problem)


def test_a_forced_backend_that_cannot_run_raises_with_its_reasons():
    args = _base_args(paged=True)
    with pytest.raises(ad.NoBackendError, match=re.escape("torch_cpu: paged KV cache not supported (only dense)")):
        ad.sdpa_with_kvcache(**args, backend="torch_cpu")


def test_kv_reasons_of_each_capability():
    """not_supported_reasons for each KV-cache field, on a custom declaration."""
    problem = ad.explain_with_kvcache(**_base_args(paged=True)).problem
    reasons = ad.not_supported_reasons
    assert reasons(ad.Capabilities(), problem) == ["KV-cache calls (sdpa_with_kvcache) not supported"]
    dense_only = ad.Capabilities(kv_cache=frozenset({"dense"}), kv_append=False, kv_multi_query=False)
    assert reasons(dense_only, problem) == [
        "paged KV cache not supported (only dense)",
        "k_new/v_new (appending into the cache) not supported",
        "Sq=2 new queries per sequence not supported (only Sq=1)",
    ]
    fa2_like = ad.Capabilities(kv_cache=frozenset({"dense", "paged"}), paged_block_size_multiple=256)
    assert reasons(fa2_like, problem) == ["paged block_size=16 not supported (allowed: multiples of 256)"]
    no_br = ad.Capabilities(kv_cache=frozenset({"dense", "paged"}), causal_kinds=frozenset({ad.CausalKind.TOP_LEFT}))
    causal = ad.explain_with_kvcache(**{**_base_args(), "causal": True}).problem
    assert reasons(no_br, causal) == [
        "causal=bottom_right with a KV cache (aligned to each sequence's length) (the backend aligns causal top_left)"
    ]
    assert reasons(ad.Capabilities(kv_cache=frozenset({"paged"})), problem) == []


def test_info_table_shows_the_kv_fields():
    rows = dict(ad.get_backend("triton").capabilities.rows())
    assert rows["KV cache"] == "dense, paged" and rows["paged block size"] == "powers of two >= 16"
    assert rows["KV append"] == "yes" and rows["KV Sq > 1"] == "yes"
    rows = dict(ad.get_backend("torch_flash").capabilities.rows())
    assert (rows["KV cache"], rows["paged block size"], rows["KV append"]) == ("-", "-", "-")
    assert dict(ad.get_backend("math").capabilities.rows())["paged block size"] == "any"


def test_calls_are_recorded_like_sdpa():
    args = _base_args()
    with ad.record() as decisions:
        ad.sdpa_with_kvcache(**args, backend="math")
        ad.sdpa_with_kvcache(**{**args, "k_new": None, "v_new": None}, backend="torch_cpu")
    assert [d.backend for d in decisions] == ["math", "torch_cpu"]
    assert ad.last_decision().backend == "torch_cpu" and not ad.last_decision().problem.kv_append


def test_on_error_fallback_takes_the_next_eligible_backend(monkeypatch):
    args = _base_args()
    from attention_dispatch.backends.torch_backends import TorchCpuBackend

    def broken(self, *a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(TorchCpuBackend, "run_kvcache", broken)
    with ad.use_backends("torch_cpu", "math"):
        with pytest.raises(ad.BackendRunError, match="backend 'torch_cpu' failed while running: RuntimeError: boom"):
            ad.sdpa_with_kvcache(**args)
        with ad.use_config({"dispatch": {"on_error": "fallback"}}):
            out = ad.sdpa_with_kvcache(**args)
    assert ad.last_decision().backend == "math" and "torch_cpu" in ad.last_decision().failures
    assert out.shape == (2, 4, 2, 16)


def test_a_decode_loop_hits_the_decision_cache(monkeypatch):
    """cache_seqlens grows by one per step: one decision for the whole generation."""
    evaluations = []
    evaluate = dispatch.evaluate
    monkeypatch.setattr(dispatch, "evaluate", lambda *a, **kw: evaluations.append(a[0]) or evaluate(*a, **kw))
    case = KvCase(batch=2, capacity=32, block_size=16, append=True, lengths=(0, 5))
    args = make_kv_inputs(case)
    k, v = args["k_cache"].clone(), args["v_cache"].clone()
    seqlens = args["cache_seqlens"]
    for step in range(6):
        args["query"] = torch.randn_like(args["query"])
        args["k_new"], args["v_new"] = torch.randn_like(args["k_new"]), torch.randn_like(args["v_new"])
        out = ad.sdpa_with_kvcache(**args)
        k, v = reference_append(k, v, seqlens, args["k_new"], args["v_new"], args["block_table"])
        lengths = [n + 1 for n in seqlens.tolist()]
        ref = kv_reference(args["query"], k, v, lengths, block_table=args["block_table"])
        assert_matches(out, ref, None, f"step {step}", dtype=torch.float32)
        seqlens = args["cache_seqlens"] = seqlens + 1
    assert torch.equal(args["k_cache"], k)
    assert len(evaluations) == 1, f"{len(evaluations)} decisions for one generation"
    assert ad.last_decision().backend == "triton"


# ---- CUDA graphs ---------------------------------------------------------------------------


def _graph_backends():
    return [
        pytest.param(name, paged, id=f"{name}-{'paged' if paged else 'dense'}")
        for name in ("triton", "cudnn", "torch_efficient")
        for paged in (False, True)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,paged", _graph_backends())
def test_cuda_graph_capture_and_replay(backend, paged):
    """Captured once; between replays the query, k_new/v_new, the cache's contents,
    cache_seqlens and block_table change in place; every replay matches the reference."""
    case = KvCase(
        dtype=torch.bfloat16,
        batch=3,
        heads_q=8,
        heads_kv=8 if backend == "torch_efficient" else 2,
        seqlen_q=2,
        capacity=256,
        head_dim=128,
        block_size=16 if paged else None,
        append=True,
        causal=True,
        lengths=(0, 100, 254),
    )
    args = make_kv_inputs(case, "cuda")
    decision = ad.explain_with_kvcache(**args, backend=backend)
    if decision.backend is None:
        pytest.skip(f"{backend}: " + "; ".join(decision.rejected.get(backend, [])))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and decide outside the capture
        for _ in range(2):
            ad.sdpa_with_kvcache(**args, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ad.sdpa_with_kvcache(**args, backend=backend)
    for step, lengths in enumerate(((5, 0, 254), (200, 17, 3), (254, 254, 0))):
        for name in ("query", "k_new", "v_new", "k_cache", "v_cache"):
            args[name].copy_(torch.randn_like(args[name]))
        args["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        if paged:
            per_seq = case.capacity // case.block_size
            perm = torch.randperm(args["k_cache"].shape[0])[: case.batch * per_seq]
            args["block_table"].copy_(perm.reshape(case.batch, per_seq).to(torch.int32))
        k0, v0 = args["k_cache"].cpu(), args["v_cache"].cpu()
        graph.replay()
        torch.cuda.synchronize()
        table = None if args["block_table"] is None else args["block_table"].cpu()
        k, v = reference_append(k0, v0, torch.tensor(lengths), args["k_new"].cpu(), args["v_new"].cpu(), table)
        assert torch.equal(args["k_cache"].cpu(), k) and torch.equal(args["v_cache"].cpu(), v), f"replay {step}: cache"
        total = [n + case.seqlen_q for n in lengths]
        q = args["query"].cpu()
        ref64 = kv_reference(q, k, v, total, block_table=table, causal=True)
        ref_low = kv_reference(q, k, v, total, block_table=table, causal=True, dtype=case.dtype)
        assert_matches(out.cpu(), ref64, ref_low, f"{backend} replay {step}", dtype=case.dtype)


def test_explain_with_kvcache_shows_the_triton_route():
    """The route inside the triton backend, with why the faster kernel was passed over, as explain()'s."""
    if "triton" not in ad.list_backends() or not ad.get_backend("triton").is_available():
        pytest.skip("triton unavailable")
    args = make_kv_inputs(KvCase())
    d = ad.explain_with_kvcache(**args, backend="triton")
    assert d.route is not None and str(d.route) == "decode split-KV forward"
    assert "route: decode split-KV forward (not gluon cache forward: " in str(d)
    assert ad.explain_with_kvcache(**args, backend="math").route is None


@pytest.mark.gpu
@pytest.mark.parametrize("label", [label for label in CASES if "past the first row block" in label])
def test_gpu_append_past_the_first_row_block(label):
    """The decode kernel's append on the GPU: every new key in the cache, the output as defined."""
    check_kv_call("triton", CASES[label], "cuda")


@pytest.mark.parametrize("backend", ["math", "triton"])
def test_under_torch_compile_the_call_runs_eagerly(backend):
    """torch.compile of a decode step: sdpa_with_kvcache is a graph break that runs eagerly (its in-place
    cache writes included; tracing into its launches once failed), and fullgraph=True says it cannot."""
    import torch._dynamo

    case = KvCase(seqlen_q=2, append=True, causal=True, layouts=("contiguous",) * 3 + ("tokens_first", "contiguous"))
    if not ad.get_backend(backend).is_available():
        pytest.skip(ad.get_backend(backend).unavailable_reason())

    def step(args):
        return ad.sdpa_with_kvcache(**args, backend=backend) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager")
    for _ in range(2):
        args = make_kv_inputs(case)
        want = check_kv_call(
            backend, case, args={n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
        )
        k0 = args["k_cache"].clone()
        got = compiled(args)
        assert torch.equal(got, want * 2)
        assert not torch.equal(args["k_cache"], k0), "the cache was not written"
    torch._dynamo.reset()  # else the graph above serves the fullgraph call too
    with pytest.raises(Exception, match="(?i)disable|skip"):
        torch.compile(step, backend="eager", fullgraph=True)(make_kv_inputs(case))
    torch._dynamo.reset()


def test_the_compiled_path_forwards_every_parameter():
    """sdpa_with_kvcache's torch.compile branch passes each of its parameters on by name: one added to the
    signature but not there would be dropped under torch.compile, silently."""
    import ast
    import inspect

    from attention_dispatch import kvcache

    tree = ast.parse(inspect.getsource(kvcache.sdpa_with_kvcache))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Call)
        and getattr(n.func.func, "id", "") == "_eager_sdpa_with_kvcache"
    ]
    assert len(calls) == 1
    passed = {k.arg: k.value.id for k in calls[0].keywords}
    params = list(inspect.signature(kvcache.sdpa_with_kvcache).parameters)
    assert passed == {p: p for p in params}
