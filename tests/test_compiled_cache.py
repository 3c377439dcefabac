"""Direct relaunch of compiled Triton kernels (attention_dispatch/kernels/compiled_cache.py).

CPU: the cache logic against a fake Triton kernel that records every launch, and the real
kernels' launches checked to be of the shape the cache can relaunch.  GPU: one process
mixes specialisations (alignment, ints equal to 1 / multiples of 16, strides) and every
result is compared with the float64 reference, so a relaunch with the wrong compiled
kernel cannot pass.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_triton_kernel import run_and_check  # noqa: E402

from attention_dispatch.kernels import KernelParams, is_interpreter, triton_attention  # noqa: E402
from attention_dispatch.kernels import compiled_cache as cc  # noqa: E402
from attention_dispatch.kernels import launch_replay, replay, run  # noqa: E402
from attention_dispatch.kernels.tl import KERNELS as TL_KERNELS  # noqa: E402
from attention_dispatch.kernels.tl import launch as tl_launch  # noqa: E402


class _FakeCompiled:
    def __init__(self, log):
        self.log = log
        self.function = object()
        self.packed_metadata = ("meta",)

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *args):
        assert function is self.function and metadata == self.packed_metadata
        self.log.append(("direct", (g0, g1, g2), args, stream))


class _FakeKernel:
    """Triton's JITFunction interface: arg_names and kernel[grid](*args, **kw)."""

    arg_names = ["X", "Y", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def runner(*args, num_warps, num_stages, **kw):
            self.log.append(("jit", grid, args, kw, num_warps, num_stages))
            return _FakeCompiled(self.log)

        return runner


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setattr(cc, "hooks_installed", lambda: False)
    return cc.CompiledLaunchCache()


def _launch(cache, kern, x, y, n, scale=0.5, block=16, flag=True, grid=(3, 2)):
    # constexprs given in another order than the signature's: the relaunch must reorder them
    cache.launch(kern, grid, (x, y, n, scale), dict(FLAG=flag, BLOCK=block), 4, 3)


def test_second_launch_goes_direct_with_args_in_signature_order(cache, monkeypatch):
    stream = []
    monkeypatch.setattr(cc, "current_stream", lambda: stream.append(1) or 1234)
    kern, x, y = _FakeKernel(), torch.zeros(8), torch.zeros(8)
    _launch(cache, kern, x, y, 32)
    _launch(cache, kern, x, y, 32, grid=(5, 1, 2))
    assert [e[0] for e in kern.log] == ["jit", "direct"]
    assert kern.log[0][3] == dict(FLAG=True, BLOCK=16) and kern.log[0][4:] == (4, 3)
    assert kern.log[1][1] == (5, 1, 2)
    assert kern.log[1][2] == (x, y, 32, 0.5, 16, True)  # BLOCK before FLAG, as declared
    assert kern.log[1][3] == 1234  # the current stream
    assert stream == [1]
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_value", "float_value", "constexpr"])
def test_any_change_triton_may_specialise_on_compiles_again(cache, change):
    kern = _FakeKernel()
    x, y = torch.zeros(16), torch.zeros(16)
    _launch(cache, kern, x, y, 32)
    if change == "misaligned":
        _launch(cache, kern, x[1:], y, 32)  # 4-byte offset: not 16-byte aligned
    elif change == "dtype":
        _launch(cache, kern, x.half(), y, 32)
    elif change == "int_value":
        _launch(cache, kern, x, y, 1)  # Triton specialises ints equal to 1
    elif change == "float_value":
        _launch(cache, kern, x, y, 32, scale=0.25)
    else:
        _launch(cache, kern, x, y, 32, block=32)
    assert [e[0] for e in kern.log] == ["jit", "jit"]
    assert cache.misses == 2 and cache.hits == 0


@pytest.mark.skipif(cc.TensorDescriptor is None, reason="this Triton has no host-side tensor descriptors")
def test_host_descriptors_are_keyed_by_what_compiles_and_passed_through(cache, monkeypatch):
    """A host-built TMA descriptor among the arguments (an unhashable dataclass) is keyed by
    its base's dtype and alignment, its shape, strides, block and padding: the same spec over
    new tensors relaunches directly with the new descriptor, any other spec compiles again."""
    monkeypatch.setattr(cc, "current_stream", lambda: 0)
    kern = _FakeKernel()

    def desc(t, rows=16, shape=(64, 16)):
        return cc.TensorDescriptor(t, list(shape), [shape[1], 1], [rows, shape[1]])

    x, y = torch.randn(64, 16), torch.randn(64, 16)
    _launch(cache, kern, x, y, 64, scale=desc(x))
    x2 = torch.randn(64, 16)
    d2 = desc(x2)
    _launch(cache, kern, x2, y, 64, scale=d2)
    assert [e[0] for e in kern.log] == ["jit", "direct"] and kern.log[1][2][3] is d2
    for other in (desc(x, rows=32), desc(x.half()), desc(x, shape=(32, 32)), desc(x, shape=(48, 16))):
        _launch(cache, kern, x, y, 64, scale=other)
    assert [e[0] for e in kern.log] == ["jit", "direct"] + ["jit"] * 4
    assert (cache.hits, cache.misses, len(cache)) == (1, 5, 5)


class _FakeGluonKernel(_FakeKernel):
    """A descriptor-first kernel (the Gluon kernels' shape, kernels/gluon/): descriptors, a pointer, scalars."""

    arg_names = ["QD", "OD", "LSE", "scale", "n", "FLAG"]


class _FakeFusedDqKernel(_FakeKernel):
    """The same with the dK/dV pass's FUSE_DQ constexpr."""

    arg_names = ["QD", "OD", "LSE", "scale", "n", "FLAG", "FUSE_DQ"]


def _gluon_descriptor(t, rows=16, swizzle=64):
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * t.element_size(), rank=2)
    return cc.GluonDescriptor(t, list(t.shape), [t.shape[1], 1], [rows, t.shape[1]], layout)


@pytest.mark.skipif(cc.GluonDescriptor is None, reason="this Triton has no Gluon")
def test_gluon_kernels_are_keyed_argument_by_argument(cache, monkeypatch):
    """A descriptor-first (Gluon) kernel: descriptors keyed by what compiles (incl. their
    shared-memory layout), later pointers by dtype and alignment (not identity): the same spec
    over new tensors relaunches directly with the new arguments, any other spec compiles again;
    launch options (maxnreg) are passed to Triton and are part of the key."""
    monkeypatch.setattr(cc, "current_stream", lambda: 0)
    kern = _FakeGluonKernel()

    def go(q, o, lse, desc=_gluon_descriptor, maxnreg=168):
        cache.launch(kern, (2, 1), (desc(q), desc(o), lse, 0.5, 64), dict(FLAG=True), 4, 3, maxnreg=maxnreg)

    go(*(torch.randn(64, 16) for _ in range(2)), torch.randn(64))
    q2, o2, lse2 = torch.randn(64, 16), torch.randn(64, 16), torch.randn(64)
    go(q2, o2, lse2)
    assert [e[0] for e in kern.log] == ["jit", "direct"] and kern.log[0][3] == dict(FLAG=True, maxnreg=168)
    args = kern.log[1][2]
    assert args[0].base is q2 and args[1].base is o2 and args[2] is lse2 and args[3:] == (0.5, 64, True)
    others = [
        dict(desc=lambda t: _gluon_descriptor(t, rows=32)),
        dict(desc=lambda t: _gluon_descriptor(t, swizzle=32)),
        dict(maxnreg=240),
    ]
    for kw in others:
        go(torch.randn(64, 16), torch.randn(64, 16), torch.randn(64), **kw)
    go(torch.randn(64, 16), torch.randn(64, 16), torch.randn(64).half())
    assert [e[0] for e in kern.log] == ["jit", "direct"] + ["jit"] * 4
    assert (cache.hits, cache.misses, len(cache)) == (1, 5, 5)
    assert cc.rebase(args[0], o2).base is o2 and cc.rebase(args[0], o2).layout == args[0].layout


@pytest.mark.skipif(cc.GluonDescriptor is None, reason="this Triton has no Gluon")
def test_rebase_copies_every_field_and_still_checks_the_base():
    """rebase() keeps every field of the descriptor but its base (without re-running the
    constructor's checks); a base of another dtype or a misaligned one goes through the
    constructor, which checks it."""
    src = _gluon_descriptor(torch.randn(64, 16))
    new_base = torch.randn(64, 16)
    moved = cc.rebase(src, new_base)
    assert type(moved) is type(src) and moved.base is new_base and src.base is not new_base
    assert {k: v for k, v in vars(moved).items() if k != "base"} == {k: v for k, v in vars(src).items() if k != "base"}
    misaligned = torch.randn(64 * 16 + 1)[1:].view(64, 16)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        cc.rebase(src, misaligned)
    with pytest.raises(AssertionError):  # fp16 under a layout of 32-bit elements: the constructor refuses it
        cc.rebase(src, torch.randn(64, 16).half())


def _planned_gluon_forward(cache, monkeypatch, pointer):
    """A ForwardPlan whose forward is one fake Gluon launch: descriptors over q and the output, then
    ``pointer(q, out)``, the scale and 64.  Returns (the plan, each relaunch's arguments, the
    queries of the calls that took the full path)."""
    from attention_dispatch.kernels import ForwardPlan

    monkeypatch.setattr(cc, "current_stream", lambda: 0)
    monkeypatch.setattr(replay, "hooks_installed", lambda: False)  # replay.py's own names
    kern, relaunched, full = _FakeGluonKernel(), [], []

    def forward(q, k, v, bias, params, need_lse):
        full.append(q)
        out = torch.empty_like(q)
        args = (_gluon_descriptor(q), _gluon_descriptor(out), pointer(q, out), params.scale, 64)
        cache.launch(kern, (1,), args, dict(FLAG=True), 4, 3)
        return out, None, None

    monkeypatch.setattr(replay, "attention_forward", forward)
    monkeypatch.setattr(launch_replay, "relaunch", lambda entry, grid, args: relaunched.append(args))
    return ForwardPlan(torch.randn(64, 16), KernelParams(scale=0.5)), relaunched, full


@pytest.mark.skipif(cc.GluonDescriptor is None, reason="this Triton has no Gluon")
def test_forward_plan_rebuilds_gluon_descriptors_and_later_pointers(cache, monkeypatch):
    """A forward whose one launch is a Gluon kernel (descriptors over q and the output, the
    output again as a later pointer) is captured by the plan, and each later call relaunches it
    with descriptors rebuilt over the new query and output and the new output's pointer."""
    plan, relaunched, _ = _planned_gluon_forward(cache, monkeypatch, lambda q, out: out)
    q = torch.randn(64, 16)
    plan(q, q, q)
    assert plan.launch is not None and [(i, d is None) for _, i, d in plan.launch.patches] == [
        (0, False),
        (3, False),
        (3, True),
    ]
    q2 = torch.randn(64, 16)
    out = plan(q2, q2, q2)
    (args,) = relaunched
    address = not is_interpreter()  # the compiled launcher takes pointers as ints
    assert args[0].base is q2 and args[1].base is out
    assert args[2] == out.data_ptr() if address else args[2] is out
    assert args[0].layout == _gluon_descriptor(q).layout and tuple(args[3:]) == (0.5, 64)


@pytest.mark.skipif(cc.GluonDescriptor is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("lengths", ["static zeros", "a tensor of the call's own"])
def test_forward_plan_keeps_the_packages_constant_buffers_and_refuses_other_tensors(cache, monkeypatch, lengths):
    """Plain sdpa()'s chunked prefill passes the Gluon forward the package's constant zeros as its
    lengths (kernels/entry.GLUON_LENGTHS): the plan captures that launch and relaunches it with the
    same buffer.  Any other tensor outside the call's own (here a lengths tensor made per call)
    keeps the full path every time."""
    from attention_dispatch.kernels.static_buffers import int32_zeros, is_static

    def lens(q, out):
        return int32_zeros(q.device, 4) if lengths == "static zeros" else torch.zeros(4, dtype=torch.int32)

    plan, relaunched, full = _planned_gluon_forward(cache, monkeypatch, lens)
    q = torch.randn(64, 16)
    plan(q, q, q)
    outs = [plan(q2, q2, q2) for q2 in (torch.randn(64, 16), torch.randn(64, 16))]
    if lengths == "static zeros":
        assert plan.launch is not None and len(full) == 1 and len(relaunched) == 2
        for args, out in zip(relaunched, outs):
            assert args[1].base is out
            assert args[2] is int32_zeros(q.device, 4) and is_static(args[2]) and tuple(args[3:]) == (0.5, 64)
        assert int(int32_zeros(q.device, 4).abs().sum()) == 0
    else:
        assert plan.launch is None and len(full) == 3 and not relaunched


def test_int32_zeros_is_one_buffer_a_device_until_outgrown():
    from attention_dispatch import clear_cache
    from attention_dispatch.kernels.static_buffers import int32_zeros, is_static

    dev = torch.device("cpu")
    a = int32_zeros(dev, 3)
    assert a is int32_zeros(dev, a.numel()) and a.dtype == torch.int32 and not a.any() and is_static(a)
    b = int32_zeros(dev, a.numel() + 1)  # outgrown: a larger one, handed out from then on
    assert b is not a and b.numel() >= a.numel() + 1 and not b.any()
    assert int32_zeros(dev, 1) is b and not is_static(torch.zeros(4, dtype=torch.int32))
    # the outgrown one stays static and alive: a CUDA graph may read it without a reference
    clear_cache()
    assert is_static(a) and is_static(b) and int32_zeros(dev, 1) is b


@pytest.mark.skipif(cc.GluonDescriptor is None, reason="this Triton has no Gluon")
def test_a_captured_plan_keeps_no_tensor_of_the_captured_call_alive(cache, monkeypatch):
    """A plan lives as long as its signature's cache entry: what it keeps of the first call (its
    descriptors, the arguments after the leading pointers) must not hold that call's tensors, or
    a training loop carries a second copy of q/k/v/out (0.76 GiB at S=64k, issue 40)."""
    import gc
    import weakref

    from attention_dispatch.kernels import ForwardPlan

    monkeypatch.setattr(cc, "current_stream", lambda: 0)
    monkeypatch.setattr(replay, "hooks_installed", lambda: False)
    kern, outs = _FakeGluonKernel(), []

    def forward(q, k, v, bias, params, need_lse):
        out = torch.empty_like(q)
        outs.append(weakref.ref(out))
        cache.launch(
            kern, (1,), (_gluon_descriptor(q), _gluon_descriptor(out), out, params.scale, 64), dict(FLAG=True), 4, 3
        )
        return out, None, None

    monkeypatch.setattr(replay, "attention_forward", forward)
    monkeypatch.setattr(launch_replay, "relaunch", lambda entry, grid, args: None)
    q = torch.randn(64, 16)
    plan = ForwardPlan(q, KernelParams(scale=0.5))
    first_q = weakref.ref(q)
    plan(q, q, q)
    assert plan.launch is not None
    kern.log.clear()  # the fake kernel's own record of its launches
    del q
    gc.collect()
    assert first_q() is None and outs[0]() is None
    q2 = torch.randn(64, 16)
    assert plan(q2, q2, q2).shape == q2.shape  # the plan still relaunches


def test_launch_hooks_keep_tritons_path(cache, monkeypatch):
    kern, x = _FakeKernel(), torch.zeros(8)
    _launch(cache, kern, x, x, 8)
    monkeypatch.setattr(cc, "hooks_installed", lambda: True)
    _launch(cache, kern, x, x, 8)
    assert [e[0] for e in kern.log] == ["jit", "jit"]


def test_no_hooks_by_default_and_an_installed_hook_is_seen():
    """Triton's knobs hold an (empty) hook chain even when no profiler is attached."""
    from triton import knobs

    assert not cc.hooks_installed()
    chain = knobs.runtime.launch_enter_hook

    def hook(metadata):
        return None

    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert cc.hooks_installed()
        finally:
            chain.remove(hook)
    else:  # older Triton: a plain attribute
        knobs.runtime.launch_enter_hook = hook
        try:
            assert cc.hooks_installed()
        finally:
            knobs.runtime.launch_enter_hook = chain
    assert not cc.hooks_installed()


def test_unexpected_signature_is_never_cached(cache):
    kern, x = _FakeKernel(), torch.zeros(8)
    for _ in range(2):  # constexprs missing from the call: Triton's defaults apply, not ours
        cache.launch(kern, (1,), (x, x, 8, 0.5), dict(BLOCK=16), 4, 3)
    assert [e[0] for e in kern.log] == ["jit", "jit"] and len(cache) == 0


def test_cache_is_bounded(cache, monkeypatch):
    monkeypatch.setattr(cc, "MAX_ENTRIES", 3)
    kern, x = _FakeKernel(), torch.zeros(8)
    for n in range(10):
        _launch(cache, kern, x, x, 100 + n)
    assert len(cache) <= 3


def _pass_of(kernel):
    """The tl.KERNELS key of a launched kernel (by identity; the kernel itself if none)."""
    return next((name for name, k in TL_KERNELS.items() if k is kernel), kernel)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_kernel_launch_is_relaunchable(monkeypatch, dev):
    """The real kernels' launches (forward, preprocess, dK/dV, dQ) have the shape the cache
    relaunches: leading pointers then scalars, and every remaining parameter a constexpr."""
    seen = {}
    real = run.launch_one

    def record(kernel, grid, args, constexprs, num_warps, num_stages, **options):
        n = cc.leading_tensors(args)
        assert not any(isinstance(a, torch.Tensor) for a in args[n:])
        assert cc.constexpr_order(kernel, len(args), constexprs) is not None, kernel
        seen[_pass_of(kernel)] = n
        return real(kernel, grid, args, constexprs, num_warps, num_stages, **options)

    if (dev == "cpu") != is_interpreter():
        pytest.skip("the CPU case runs under the interpreter, the CUDA case on a GPU")
    monkeypatch.setattr(run, "launch_one", record)
    q, k, v = (torch.randn(1, 2, 24, 16, device=dev, requires_grad=True) for _ in range(3))
    out = triton_attention(q, k, v, torch.randn(1, 2, 24, 24, device=dev), KernelParams(scale=0.25))
    out.sum().backward()
    assert set(seen) == {"fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq"}


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(is_interpreter() or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_relaunch_across_specialisations(monkeypatch):
    """Alternate calls whose specialisations differ (ints 1 / 16 / 17, a 2-byte-offset base,
    a non-contiguous layout, K/V through host-built descriptors at 128 / 256 keys): each
    repeated call is a cache hit and still exact."""
    torch.manual_seed(0)
    cc.COMPILED.clear()
    monkeypatch.setattr(tl_launch, "HOST_KV_MIN_WORK", 0)  # host descriptors at these small shapes too

    def inputs(s, offset=0, transposed=False):
        def one():
            if transposed:  # BSHD storage viewed as BHSD
                return torch.randn(2, s, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            buf = torch.randn(2 * 4 * s * 64 + offset, device="cuda", dtype=torch.bfloat16)
            return buf[offset:].view(2, 4, s, 64)

        return [one().requires_grad_() for _ in range(3)]

    cases = [
        inputs(1),
        inputs(16),
        inputs(17),
        inputs(16, offset=1),
        inputs(16, transposed=True),
        inputs(100),
        inputs(128),
        inputs(256),
    ]
    for _ in range(2):
        for q, k, v in cases:
            run_and_check(q, k, v, causal="bottom_right")
    assert cc.COMPILED.hits >= 4 * len(cases), (cc.COMPILED.hits, cc.COMPILED.misses)


def test_capture_records_direct_and_first_launches(cache, monkeypatch):
    monkeypatch.setattr(cc, "current_stream", lambda: 0)
    kern, x = _FakeKernel(), torch.zeros(8)
    with cc.CompiledLaunchCache.capture() as launches:
        _launch(cache, kern, x, x, 8)
        _launch(cache, kern, x, x, 8, grid=(7,))
    assert [(e is not None, g) for e, g, _, _ in launches] == [(True, (3, 2)), (True, (7,))]
    assert launches[0][0] is launches[1][0] and launches[1][2] == (x, x, 8, 0.5)
    _launch(cache, kern, x, x, 8)  # outside the block: nothing recorded
    assert len(launches) == 2


# ----------------------------------------------------------------------------- ForwardPlan


def _plan_inputs(dev, s=24, d=16, dtype=torch.float32):
    return [torch.randn(2, 3, s, d, device=dev, dtype=dtype) for _ in range(3)]


def _interpreted_relaunches(monkeypatch):
    """Launches recorded for capture and relaunched through the interpreter (standing in for
    the compiled launcher: a captured entry relaunches the same kernel with the given
    arguments).  Returns (the real launch, the recording one, the relaunched kernels as tl.KERNELS keys)."""
    real = run.launch_one
    relaunched = []

    def launch_and_record(kernel, grid, args, constexprs, num_warps, num_stages, **options):
        real(kernel, grid, args, constexprs, num_warps, num_stages, **options)
        cc.COMPILED.record((kernel, constexprs, num_warps, num_stages), grid, args, constexprs)

    def fake_relaunch(entry, grid, args):
        kernel, constexprs, num_warps, num_stages = entry
        relaunched.append(_pass_of(kernel))
        real(kernel, grid, args, constexprs, num_warps, num_stages)

    monkeypatch.setattr(run, "launch_one", launch_and_record)
    monkeypatch.setattr(launch_replay, "relaunch", fake_relaunch)
    return real, launch_and_record, relaunched


@pytest.mark.skipif(not is_interpreter(), reason="fake relaunch through the interpreter")
@pytest.mark.parametrize("feature", ["dense", "causal", "gqa", "bshd", "dv", "host_kv", "host_kv_bshd"])
def test_forward_plan_relaunches_with_the_new_tensors(monkeypatch, feature):
    """A plan captures the forward's one launch and later relaunches it with the new call's
    query/key/value and freshly allocated outputs (the interpreter stands in for the compiled
    launcher: the captured entry relaunches the same kernel with the given arguments).
    host_kv: K/V read through host-built descriptors, which the plan rebuilds over the new
    key/value."""
    from attention_dispatch.kernels import ForwardPlan, prepare_attention

    real, launch_and_record, relaunched = _interpreted_relaunches(monkeypatch)
    monkeypatch.setattr(tl_launch, "HOST_KV_MIN_WORK", 0)
    params = KernelParams(
        scale=0.25,
        window_right=0 if feature == "causal" else -1,
        descriptors=1 if feature.startswith("host_kv") else -1,
    )
    q, k, v = _plan_inputs("cpu", s=64 if feature.startswith("host_kv") else 24)
    if feature == "gqa":
        k, v = k[:, :1].contiguous(), v[:, :1].contiguous()
    elif feature in ("bshd", "host_kv_bshd"):  # (B, S, H, D) memory seen as (B, H, S, D): out is not q's layout
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif feature == "dv":  # value head dim != query head dim: the output is not q's shape
        v = torch.randn(2, 3, 24, 8)
    plan = prepare_attention(q, k, v, None, params)
    assert isinstance(plan, ForwardPlan)
    first = plan(q, k, v)
    assert plan.launch is not None and relaunched == []
    # the output is allocated like q (empty_like) only where that is the layout the launch captured
    assert plan.out_like_query == (feature in ("dense", "causal", "gqa", "host_kv"))
    # descriptors over key and value, kept detached from the first call's tensors (no leak)
    assert [(i, d.base.numel(), d.base.dtype) for _, i, d in plan.launch.patches if d is not None] == (
        [(1, 0, k.dtype), (2, 0, v.dtype)] if feature.startswith("host_kv") else []
    )
    for _ in range(2):
        q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))  # same shapes and strides (the contract)
        got = plan(q2, k2, v2)
        monkeypatch.setattr(run, "launch_one", real)
        want, lse = triton_attention(q2, k2, v2, None, params, return_lse=True)  # the kernel that stores the lse
        assert torch.isfinite(lse).all()
        monkeypatch.setattr(run, "launch_one", launch_and_record)
        assert torch.equal(got, want) and not torch.equal(got, first)
    assert len(relaunched) == 2


@pytest.mark.skipif(not is_interpreter(), reason="fake relaunch through the interpreter")
@pytest.mark.parametrize("feature", ["dense", "causal", "dq_split"])
def test_training_plan_replays_forward_and_backward(monkeypatch, feature):
    """A training call's plan captures the forward's launches (logsumexp included) and the
    backward's (delta, dK/dV, dQ), and replays them over the next calls' tensors (the
    interpreter stands in for the compiled launcher).  dq_split: the dQ pass split over keys
    adds into a zeroed buffer (ATOMIC), which a replay's fresh output is not: that backward is
    never replayed, the full one runs each time.  Outputs and gradients equal the unplanned
    path's in every call."""
    from attention_dispatch.kernels import TrainingPlan, prepare_attention

    real, launch_and_record, relaunched = _interpreted_relaunches(monkeypatch)
    params = KernelParams(
        scale=0.25, window_right=0 if feature == "causal" else -1, num_splits=2 if feature == "dq_split" else 0
    )
    q, k, v = (t.requires_grad_() for t in _plan_inputs("cpu"))
    runner = prepare_attention(q, k, v, None, params)
    per_call = ["fwd"] + ([] if feature == "dq_split" else ["bwd_preprocess", "bwd_dkdv", "bwd_dq"])
    plans = []
    for n in range(3):
        q2, k2, v2 = (torch.randn_like(t).requires_grad_() for t in (q, k, v))
        do = torch.randn(q.shape)
        got = runner(q2, k2, v2)
        got_grads = torch.autograd.grad(got, (q2, k2, v2), do)
        plans = [c.cell_contents for c in runner.__closure__ if isinstance(c.cell_contents, TrainingPlan)]
        monkeypatch.setattr(run, "launch_one", real)
        want = triton_attention(q2, k2, v2, None, params)
        want_grads = torch.autograd.grad(want, (q2, k2, v2), do)
        monkeypatch.setattr(run, "launch_one", launch_and_record)
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
        assert relaunched == per_call * n  # from the second call on, replayed
    (plan,) = plans
    assert plan.fwd is not None and (plan.bwd is None) == (feature == "dq_split")


@pytest.mark.skipif(cc.GluonDescriptor is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("fused_dq", [False, True])
def test_training_plan_replays_a_warp_specialised_backward(cache, monkeypatch, fused_dq):
    """A backward's launches (stand-ins here for the warp-specialised route: a pointer kernel
    over dO and delta, a descriptor-first kernel over q, dK and out) are captured once and
    replayed with each call's dO and fresh delta / dQ / dK / dV, for a dO of the captured layout;
    a dO of another layout takes the full backward.  fused_dq: the dK/dV kernel reduce-adds dQ
    into a zeroed buffer (FUSE_DQ), which a replay's fresh dQ is not: never replayed, although
    every tensor it reads is one the plan could patch."""
    from attention_dispatch.kernels import TrainingPlan

    monkeypatch.setattr(cc, "current_stream", lambda: 0)
    monkeypatch.setattr(replay, "hooks_installed", lambda: False)
    gluon = _FakeFusedDqKernel() if fused_dq else _FakeGluonKernel()
    ptr, relaunched, full = _FakeKernel(), [], []

    def backward(do, q, k, v, bias, out, lse, seed, params, delta=None, lse_pair=None):
        full.append(do)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        cache.launch(ptr, (1,), (do, delta, 16, 0.5), dict(FLAG=True, BLOCK=16), 4, 3)
        cache.launch(
            gluon,
            (2,),
            (_gluon_descriptor(q), _gluon_descriptor(dk), out, params.scale, 64),
            dict(FLAG=True, **({"FUSE_DQ": True} if fused_dq else {})),
            4,
            3,
        )
        return dq, dk, dv, None

    monkeypatch.setattr(replay, "attention_backward", backward)
    monkeypatch.setattr(launch_replay, "relaunch", lambda entry, grid, args: relaunched.append(args))
    q, k, v, out = (torch.randn(64, 16) for _ in range(4))
    lse = torch.randn(64)
    plan = TrainingPlan(q, KernelParams(scale=0.5))
    plan.backward(torch.randn(64, 16), q, k, v, out, lse)
    if fused_dq:
        assert plan.bwd is None
        plan.backward(torch.randn(64, 16), q, k, v, out, lse)
        assert plan.bwd is None and len(full) == 2 and relaunched == []
        return
    assert plan.bwd is not None and len(plan.bwd.steps) == 2 and len(full) == 1
    do2, q2, out2 = torch.randn(64, 16), torch.randn(64, 16), torch.randn(64, 16)
    dq, dk, dv = plan.backward(do2, q2, k, v, out2, lse)
    assert len(full) == 1 and len(relaunched) == 2 and dk.shape == k.shape and dq.shape == q.shape
    (p_do, p_delta, *p_rest), (g_q, g_dk, g_out, *g_rest) = relaunched
    address = not is_interpreter()

    def same(arg, t):
        return arg == t.data_ptr() if address else arg is t

    assert same(p_do, do2) and (address or (p_delta.shape == lse.shape and p_delta is not lse))
    assert tuple(p_rest) == (16, 0.5)
    assert g_q.base is q2 and g_dk.base is dk and same(g_out, out2) and tuple(g_rest) == (0.5, 64)
    plan.backward(torch.randn(16, 64).t(), q, k, v, out, lse)  # dO of another layout: the full path
    assert len(full) == 2 and len(relaunched) == 2


@pytest.mark.parametrize("what", ["grad", "bias", "dropout"])
def test_forward_plan_only_for_repeatable_inference_launches(monkeypatch, what):
    """Calls that need autograd or a bias get the full path with the parameters bound (the
    bias comes with each call); a dropout forward (its seed is drawn per call) builds a plan
    that never captures and stays exact."""
    from attention_dispatch.kernels import ForwardPlan, prepare_attention

    dev = "cpu" if is_interpreter() else "cuda"
    q, k, v = _plan_inputs(dev)
    if what == "grad":
        q.requires_grad_()
        runner = prepare_attention(q, k, v, None, KernelParams(scale=0.25))
        assert not isinstance(runner, ForwardPlan)
        runner(q, k, v).sum().backward()
        assert q.grad is not None
    elif what == "bias":
        bias = torch.randn(1, 3, 24, 24, device=dev)
        runner = prepare_attention(q, k, v, bias, KernelParams(scale=0.25))
        assert not isinstance(runner, ForwardPlan)
        other = torch.randn_like(bias)  # each call passes its own bias
        torch.testing.assert_close(runner(q, k, v, other), triton_attention(q, k, v, other, KernelParams(scale=0.25)))
    else:
        params = KernelParams(scale=0.25, dropout_p=0.3)
        plan = prepare_attention(q, k, v, None, params)
        for _ in range(2):
            torch.manual_seed(5)
            got = plan(q, k, v)
            torch.manual_seed(5)
            torch.testing.assert_close(got, triton_attention(q, k, v, None, params))
        assert plan.launch is None


def test_prepared_varlen_runner_takes_each_calls_offsets():
    """A varlen runner (no plan) binds the parameters and max_seqlen; each call passes its
    own offsets: the result is triton_attention's with those offsets, gradients included."""
    from attention_dispatch.kernels import ForwardPlan, prepare_attention

    dev = "cpu" if is_interpreter() else "cuda"
    params = KernelParams(scale=0.25, window_right=0, deterministic=True)  # bit-equal gradients
    cu = torch.tensor([0, 9, 20], dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(20, 2, 16, device=dev) for _ in range(3))
    runner = prepare_attention(q, k, v, None, params, cu, cu, 11, 11)
    assert not isinstance(runner, ForwardPlan)
    cu2 = torch.tensor([0, 11, 20], dtype=torch.int32, device=dev)
    q2, k2, v2 = (torch.randn(20, 2, 16, device=dev, requires_grad=True) for _ in range(3))
    got = runner(q2, k2, v2, cu_seqlens_q=cu2, cu_seqlens_k=cu2)
    want = triton_attention(q2, k2, v2, None, params, cu2, cu2, 11, 11)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, triton_attention(q2, k2, v2, None, params, cu, cu, 11, 11))
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q2, k2, v2), g), torch.autograd.grad(want, (q2, k2, v2), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(is_interpreter() or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq", [200, 256])
def test_gpu_sdpa_fast_path_relaunches_the_plan(monkeypatch, seq):
    """sdpa() on repeated inference calls: from the third call on, the captured launch runs
    (no compiled-cache lookup, no Triton launch), each result equal to the full path's.
    seq=256 (head dim 128: the d=64 dense configuration keeps in-kernel descriptors): K/V
    through host-built descriptors, rebuilt by the plan for each call (compiled_cache.DirectLaunch)."""
    import attention_dispatch as ad
    from attention_dispatch import dispatch
    from attention_dispatch.kernels import ForwardPlan

    relaunched = []
    monkeypatch.setattr(launch_replay, "relaunch", lambda *a: relaunched.append("relaunch") or cc.relaunch(*a))
    direct_call = cc.DirectLaunch.__call__
    monkeypatch.setattr(cc.DirectLaunch, "__call__", lambda *a: relaunched.append("direct") or direct_call(*a))
    monkeypatch.setattr(tl_launch, "HOST_KV_MIN_WORK", 0)  # host descriptors at seq=256 too
    ad.clear_cache()
    with torch.no_grad():
        for causal in (False, True):
            d = 128 if seq == 256 else 64
            q, k, v = _plan_inputs("cuda", s=seq, d=d, dtype=torch.bfloat16)
            ad.sdpa(q, k, v, is_causal=causal, backend="triton")  # full path; stores the plan
            ad.sdpa(q, k, v, is_causal=causal, backend="triton")  # the plan's first call captures
            plans = [r for _, r in dispatch.fast_calls.values() if isinstance(r, ForwardPlan)]
            assert plans and plans[-1].launch is not None
            assert sum(d is not None for _, _, d in plans[-1].launch.patches) == (2 if seq == 256 else 0)
            relaunched.clear()
            for _ in range(3):
                q, k, v = (torch.randn_like(t) for t in (q, k, v))
                before = (cc.COMPILED.hits, cc.COMPILED.misses)
                got = ad.sdpa(q, k, v, is_causal=causal, backend="triton")
                assert (cc.COMPILED.hits, cc.COMPILED.misses) == before
                want = triton_attention(q, k, v, None, KernelParams(scale=d**-0.5, window_right=0 if causal else -1))
                assert torch.equal(got, want)
            # with host-built descriptors the launch goes below Triton's descriptor handling
            assert relaunched == ["direct" if seq == 256 else "relaunch"] * 3


# -- DirectLaunch: a launcher shaped as Triton 3.6's CudaLauncher (its descriptor wrapper) -------
def _fake_triton36_driver(encoded):
    """A module with what compiled_cache._direct_parts reads from Triton 3.6's nvidia driver:
    ``_BASE_ARGS_FORMAT_LEN``, ``make_tensordesc_arg(arg, metadata)`` (here it records each
    encoding and returns a stand-in tensormap for the base address) and a launcher class whose
    ``launch`` is the wrapper closure over the C launch, ``tensordesc_indices`` and
    ``tensordesc_meta``, as ``wrap_handle_tensordesc`` builds it there."""
    import types

    mod = types.ModuleType("fake_triton36_driver")
    mod._BASE_ARGS_FORMAT_LEN = 13

    def make_tensordesc_arg(arg, metadata):
        encoded.append(arg.base.data_ptr())
        return [("tensormap", arg.base.data_ptr(), metadata["swizzle"]), *arg.shape, *arg.strides]

    def wrap_handle_tensordesc(launcher, signature, tensordesc_meta):
        tensordesc_indices = {i for i, sig in enumerate(signature) if sig.startswith("tensordesc")}

        def inner(*args):
            final_args = list(args[:13])
            k = 0
            for i, arg in enumerate(args[13:]):
                if i in tensordesc_indices:
                    final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[k]))
                    k += 1
                else:
                    final_args.append(arg)
            return launcher(*final_args)

        return inner

    class Launcher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __init__(self, raw, signature, metas):
            self.launch = wrap_handle_tensordesc(raw, signature, metas)

        def __call__(self, gx, gy, gz, stream, function, *args):
            self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)

    Launcher.__module__ = mod.__name__
    mod.make_tensordesc_arg, mod.Launcher = make_tensordesc_arg, Launcher
    return mod


@pytest.mark.skipif(cc.TensorDescriptor is None, reason="Triton without host-built descriptors")
def test_direct_launch_passes_what_triton_36s_wrapper_passes_and_keeps_tensormaps_per_address(monkeypatch):
    """A captured launch with two descriptors, two pointers and scalars: DirectLaunch gives the
    C launch exactly the values Triton's own wrapper gives it for the same tensors (the
    descriptors rebuilt over them), encodes a tensormap only for an address not seen before,
    and keeps at most MAX_TENSORMAPS per descriptor."""
    encoded, raw_calls = [], []
    mod = _fake_triton36_driver(encoded)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(cc, "current_stream", lambda: 1234)
    signature = ["tensordesc<bf16[64, 64]>", "*bf16", "tensordesc<bf16[64, 64]>", "*fp32", "fp32", "i32", "constexpr"]
    metas = [{"swizzle": 128}, {"swizzle": 64}]
    launcher = mod.Launcher(lambda *a: raw_calls.append(a), signature, metas)
    entry = (launcher, "function", ("packed", "metadata"), (True,))  # tail: the constexpr's value

    def tensors(n=256):
        return (
            [torch.randn(n, 64, dtype=torch.bfloat16) for _ in range(2)],
            torch.randn(n, 64, dtype=torch.bfloat16),
            torch.randn(n, dtype=torch.float32),
        )

    (a, b), p, lse = tensors()
    da, db = (cc.TensorDescriptor(t, list(t.shape), list(t.stride()), [64, 64]) for t in (a, b))
    args = (da, p, db, lse, 0.5, 7)
    pool = (a, b, p, lse)  # what the replay's pool holds, in its order
    direct = cc.DirectLaunch.build(entry, (3, 2), args, {1: 2, 3: 3}, {0: 0, 2: 1})
    assert direct is not None

    def through_triton(pool):
        full = (cc.rebase(da, pool[0]), pool[2].data_ptr(), cc.rebase(db, pool[1]), pool[3].data_ptr(), 0.5, 7)
        cc.relaunch(entry, (3, 2), full)
        return raw_calls.pop()

    def direct_call(pool):
        direct([t.data_ptr() for t in pool], pool)
        return raw_calls.pop()

    for step in range(4):
        if step % 2:  # new tensors every other call; the same ones in between
            (a2, b2), p2, lse2 = tensors()
            pool = (a2, b2, p2, lse2)
        encoded.clear()
        want = through_triton(pool)
        n_triton = len(encoded)
        encoded.clear()
        got = direct_call(pool)
        assert got == want and n_triton == 2
        assert got[3] == 1234 and got[:3] == (3, 2, 1) and got[6] is True
        assert len(encoded) == (2 if step % 2 else 0), (step, encoded)  # only new addresses are encoded
    assert direct.hits == 4 and direct.misses == 4
    # each descriptor keeps at most MAX_TENSORMAPS addresses
    monkeypatch.setattr(cc, "MAX_TENSORMAPS", 3)
    for _ in range(5):
        (a3, b3), p3, lse3 = tensors(64)
        pool = (a3, b3, p3, lse3)
        assert direct_call(pool) == through_triton(pool)
    assert all(len(maps) <= 3 for *_, maps in direct.descriptors)


@pytest.mark.skipif(cc.TensorDescriptor is None, reason="Triton without host-built descriptors")
def test_direct_launch_keeps_no_captured_tensor_alive(monkeypatch):
    """DirectLaunch keeps tensormaps per address, never the tensors: neither the captured
    call's nor a later call's."""
    import gc
    import weakref

    mod = _fake_triton36_driver([])
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(cc, "current_stream", lambda: 0)
    calls = []
    signature = ["tensordesc<bf16[64, 64]>", "*bf16"]
    launcher = mod.Launcher(lambda *a: calls.append(a), signature, [{"swizzle": 128}])
    entry = (launcher, "function", ("packed",), ())
    a, p = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    direct = cc.DirectLaunch.build(
        entry, (1,), (cc.TensorDescriptor(a, [64, 64], [64, 1], [64, 64]), p), {1: 1}, {0: 0}
    )
    assert direct is not None
    a2, p2 = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    direct([a2.data_ptr(), p2.data_ptr()], (a2, p2))
    refs = [weakref.ref(t) for t in (a, p, a2, p2)]
    del a, p, a2, p2
    gc.collect()
    assert [r() for r in refs] == [None] * 4 and calls


def test_direct_launch_is_refused_for_launchers_it_does_not_know(monkeypatch):
    """Any launcher not shaped as Triton 3.6's (no wrapper closure, scratch memory per launch,
    an encoder with another signature, descriptor arguments other than the captured ones, no
    compiled entry) keeps relaunch()."""
    mod = _fake_triton36_driver([])
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    signature = ["tensordesc<bf16[64, 64]>", "*bf16"]
    good = mod.Launcher(lambda *a: None, signature, [{"swizzle": 128}])
    t = torch.randn(64, 64, dtype=torch.bfloat16)
    if cc.TensorDescriptor is None:
        pytest.skip("this Triton builds no descriptors on the host")
    d = cc.TensorDescriptor(t, [64, 64], [64, 1], [64, 64])

    def build(launcher, descriptors={0: 0}, pointers={1: 1}):
        return cc.DirectLaunch.build((launcher, "f", "m", ()), (1,), (d, t), pointers, descriptors)

    assert build(good) is not None  # the launcher it knows: every refusal below is the launcher's or the args'
    assert build(good, descriptors={}) is None  # a descriptor it would not rebuild
    assert build(good, descriptors={0: 0, 1: 1}, pointers={}) is None
    assert cc.DirectLaunch.build(None, (1,), (d, t), {1: 1}, {0: 0}) is None
    scratch = mod.Launcher(lambda *a: None, signature, [{"swizzle": 128}])
    scratch.global_scratch_size = 512
    plain = mod.Launcher(lambda *a: None, ["*bf16", "*bf16"], [])  # no descriptor: Triton wraps nothing
    plain.launch = lambda *a: None
    assert build(scratch) is None and build(plain) is None
    monkeypatch.setattr(mod, "make_tensordesc_arg", lambda arg, metadata, extra: [])  # Triton 3.9's signature
    assert build(good) is None
