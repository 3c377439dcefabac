"""What a repeated sdpa_with_kvcache() call (a hit: kv_fast_key) runs besides its backend (issue
34: host time of a decode step <= F.sdpa's on CUDA, where each device op is a launch): no device
op beyond the backend's own, and on the `triton` backend its decode plan relaunched
(Backend.prepare_kvcache, kernels.decode_plan.KvRunner; the Gluon route's launch replayed,
kernels.decode.CacheRunner) with none of run_kvcache()'s argument
processing, lengths or block tables of another layout going to run_kvcache()."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attention_dispatch as ad
from attention_dispatch.backends.triton import TritonBackend
from attention_dispatch.kernels import run as kernel_run
from attention_dispatch.kvcache import normalize_kvcache
from oracle import assert_matches
from test_kvcache import KvCase, kv_reference, make_kv_inputs, reference_append


class _AtenOps(TorchDispatchMode):
    """The aten ops run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _kv_claims():
    """(backend, layout) for every backend available here that declares a KV-cache layout."""
    claims = []
    for name in ad.list_backends():
        backend = ad.get_backend(name)
        caps = backend.capabilities
        if backend.is_available() and "cpu" in caps.devices and torch.float32 in caps.dtypes:
            claims += [(name, layout) for layout in ("dense", "paged") if layout in caps.kv_cache]
    return claims


def _case(layout: str, **kw) -> KvCase:
    return KvCase(block_size=16 if layout == "paged" else None, lengths=(9, 0, 30), **kw)


@pytest.mark.parametrize("int_lengths", [False, True], ids=["tensor lengths", "int lengths"])
@pytest.mark.parametrize(("name", "layout"), _kv_claims())
def test_a_hit_runs_no_device_op_beyond_the_backends_own(monkeypatch, name, layout, int_lengths):
    """At most the lengths tensor that an int cache_seqlens is made into (as the full path)."""
    monkeypatch.setattr(kernel_run, "launch_one", lambda *a, **kw: None)  # the kernels' own ops are not counted
    args = make_kv_inputs(_case(layout, append=True))
    if int_lengths:
        args["cache_seqlens"] = 7
    backend = ad.get_backend(name)
    call = normalize_kvcache(**args, validate=False)
    with torch.no_grad():
        for _ in range(2):  # the second call is a hit
            ad.sdpa_with_kvcache(**args, backend=name, validate=False)
        with _AtenOps() as hit:
            ad.sdpa_with_kvcache(**args, backend=name, validate=False)
        with _AtenOps() as alone:
            backend.run_kvcache(call.query, call.k_cache, call.v_cache, call.cache_seqlens, **call.options)
    allowed = len(alone.ops) + int_lengths
    assert len(hit.ops) <= allowed, f"a hit ran {hit.ops}, the backend alone {alone.ops}"


def _count_run_kvcache(monkeypatch) -> list:
    calls = []
    real = TritonBackend.run_kvcache

    def counting(self, *args, **kw):
        calls.append(1)
        return real(self, *args, **kw)

    monkeypatch.setattr(TritonBackend, "run_kvcache", counting)
    return calls


def _triton():
    backend = ad.get_backend("triton")
    if not backend.is_available():
        pytest.skip(backend.unavailable_reason())


def _steps(args, steps: int):
    """``steps`` calls of one signature, lengths and contents new each call, each against the
    float64 reference (appending into copies of the caches as the call appends into them)."""
    k, v = args["k_cache"].clone(), args["v_cache"].clone()
    for step in range(steps):
        args["query"] = torch.randn_like(args["query"])
        lens = args["cache_seqlens"]
        n_new = 0
        if args.get("k_new") is not None:
            args["k_new"], args["v_new"] = torch.randn_like(args["k_new"]), torch.randn_like(args["v_new"])
            k, v = reference_append(k, v, lens, args["k_new"], args["v_new"], args.get("block_table"))
            n_new = args["query"].shape[2]
        out = ad.sdpa_with_kvcache(**args, backend="triton")
        table = args.get("block_table")
        ref = kv_reference(  # on the CPU (the reference's masks are built there)
            args["query"].cpu(),
            k.cpu(),
            v.cpu(),
            [n + n_new for n in lens.tolist()],
            block_table=None if table is None else table.cpu(),
            causal=args["causal"],
            window=args["window"],
        )
        assert_matches(out, ref, None, f"step {step}")
        args["cache_seqlens"] = lens.flip(0).contiguous()  # other lengths, same layout


@pytest.mark.parametrize(
    ("layout", "append", "options"),
    [
        ("dense", False, {}),
        ("dense", True, {}),
        ("paged", True, {}),
        ("dense", True, {"causal": True, "window": (5, 0)}),
    ],
    ids=["dense", "dense-append", "paged-append", "dense-append-causal-window"],
)
def test_triton_hits_relaunch_the_plan_and_match_the_reference(monkeypatch, layout, append, options):
    _triton()
    seqlen_q = 2 if options else 1
    args = make_kv_inputs(_case(layout, append=append, seqlen_q=seqlen_q, **options))
    calls = _count_run_kvcache(monkeypatch)
    _steps(args, 4)
    assert len(calls) == 1, f"run_kvcache ran {len(calls)} times in 4 calls of one signature (the first only)"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_triton_hits_on_cuda_relaunch_the_plan_and_match_the_reference(monkeypatch, layout):
    """The compiled kernels relaunched directly (kernels.compiled_cache.relaunch): a decode step's shapes."""
    _triton()
    case = KvCase(
        dtype=torch.bfloat16,
        batch=2,
        heads_q=32,
        heads_kv=8,
        capacity=1024,
        head_dim=128,
        block_size=16 if layout == "paged" else None,
        append=True,
        lengths=(700, 3),
    )
    args = make_kv_inputs(case, "cuda")
    calls = _count_run_kvcache(monkeypatch)
    _steps(args, 4)
    assert len(calls) == 1


@pytest.mark.gpu
def test_triton_hits_on_the_gluon_route_replay_its_launch_and_match_the_reference(monkeypatch):
    """Many new queries over a dense cache (kernels.decode.CacheRunner): the first hit captures
    cache_forward's launch, later hits relaunch it over the new tensors (no cache_forward call)."""
    from attention_dispatch.kernels import decode
    from attention_dispatch.kernels.params import KernelParams

    _triton()
    case = KvCase(
        dtype=torch.bfloat16, batch=2, heads_q=16, heads_kv=4, seqlen_q=128, capacity=8192, head_dim=128,
        append=True, causal=True, lengths=(8000, 63),
    )  # fmt: skip
    args = make_kv_inputs(case, "cuda")
    route, why_not = decode.kv_route(
        args["query"], args["k_cache"], args["v_cache"], None, KernelParams(scale=1.0, window_right=0)
    )
    if route != decode.CACHE_GLUON:
        pytest.skip(f"not the Gluon route here: {why_not}")
    calls = _count_run_kvcache(monkeypatch)
    forwards = []
    real = decode.cache_forward
    monkeypatch.setattr(decode, "cache_forward", lambda *a, **kw: forwards.append(1) or real(*a, **kw))
    _steps(args, 4)
    assert len(calls) == 1
    assert len(forwards) == 2, f"cache_forward ran {len(forwards)} times in 4 calls (the full path and the capture)"


def test_lengths_or_block_table_of_another_layout_take_run_kvcache(monkeypatch):
    """The signature keeps only the lengths' and block table's shapes: a prepared plan relaunched
    with another stride or pointer alignment would read the wrong entries."""
    _triton()
    args = make_kv_inputs(_case("paged", append=True))
    calls = _count_run_kvcache(monkeypatch)
    _steps(args, 2)
    assert len(calls) == 1
    lens, table = args["cache_seqlens"], args["block_table"]
    shifted = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    shifted[1:] = lens
    strided = torch.zeros(2 * lens.numel(), dtype=torch.int32)
    strided[::2] = lens
    wide = torch.full((table.shape[0], table.shape[1] + 3), -1, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    for what, value in (
        ("cache_seqlens", shifted[1:]),  # 4 bytes past 16-byte alignment
        ("cache_seqlens", strided[::2]),
        ("block_table", wide[:, : table.shape[1]]),
    ):
        before = len(calls)
        _steps({**args, what: value}, 1)
        assert len(calls) == before + 1, f"{what} of another layout did not take run_kvcache"
