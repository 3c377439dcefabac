"""The KV-cache append (issue 34): the Triton kernel (kernels/tl/kv_append.py, one launch for keys
and values) writes what the torch ops (kernels/kv_append.append_kv_torch) and the definition
(test_kvcache.reference_append) write, and nothing else: caches are NaN-filled and compared bit
for bit where written, NaN for NaN elsewhere, the storage around strided views included (the
kernel's NaNs keep the fill's bits).  Dense and paged (block sizes 16 and 256,
random block tables), lengths 0 and capacity - Sn, new rows across a page boundary, caches, new
rows, lengths and tables through their own strides.  On the CPU the kernel runs under
TRITON_INTERPRET=1 (conftest); append_kv itself keeps the torch ops there.  On a GPU: one launch,
captured in a CUDA graph and replayed with new lengths and block tables."""

import pytest
import torch

from attention_dispatch.kernels import kv_append as kv_append_launch
from attention_dispatch.kernels import run
from attention_dispatch.kernels.kv_append import append_kv, append_kv_kernel, append_kv_torch
from attention_dispatch.kernels.tl.kv_append import _kv_append
from test_kvcache import reference_append

BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
B, HKV, D = 4, 2, 40  # GQA-shaped (Hkv of Hq = 8); D not a power of two: the head dim's padding is masked
KINDS = {"dense": None, "paged16": 16, "paged256": 256}


def same_bits(a, b) -> bool:
    """Equal NaN positions, bitwise equal elsewhere (torch's bf16 scatter_ on the CPU rewrites the
    NaN payloads of elements it does not write: NaN bits are compared by :func:`untouched` only)."""
    if a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.view(BITS[a.dtype])[~a.isnan()], b.view(BITS[b.dtype])[~b.isnan()])


def untouched(*storage) -> bool:
    """Every NaN of the kernel's caches (and the storage around them) still holds the fill's bits."""
    for t in storage:
        fill = torch.full((), float("nan"), dtype=t.dtype).view(BITS[t.dtype])
        if not bool((t.view(BITS[t.dtype])[t.isnan()] == fill).all()):
            return False
    return True


def geometry(page):
    """(cache shape, capacity, max_blocks) of a dense (page None) or paged cache, 3 spare blocks."""
    if page is None:
        return (B, HKV, 96, D), 96, 0
    max_blocks = 96 // page if page < 96 else 2
    return (B * max_blocks + 3, page, HKV, D), max_blocks * page, max_blocks


def cache_pair(shape, dtype, layout, device="cpu"):
    """NaN-filled (k_cache, v_cache) of ``shape`` in ``layout``, and the storage behind them."""
    nan = float("nan")
    if layout == "contiguous":
        k, v = torch.full(shape, nan, dtype=dtype, device=device), torch.full(shape, nan, dtype=dtype, device=device)
        return k, v, (k, v)
    if layout == "middle_dims_swapped":  # (B, S, Hkv, D) storage seen as (B, Hkv, S, D), and the paged converse
        base = torch.full((2, shape[0], shape[2], shape[1], shape[3]), nan, dtype=dtype, device=device)
        return base[0].transpose(1, 2), base[1].transpose(1, 2), (base,)
    if layout == "strided_head_dim":  # every other element of the storage's rows
        base = torch.full((*shape[:3], 2 * shape[3]), nan, dtype=dtype, device=device)
        return base[..., ::2], base[..., 1::2], (base,)
    if layout == "one_buffer":  # keys and values interleaved per row: other strides than k_new's
        base = torch.full((*shape[:3], 2, shape[3]), nan, dtype=dtype, device=device)
        return base[..., 0, :], base[..., 1, :], (base,)
    if layout == "keys_and_values_apart":  # two layouts: no stride of one may stand for the other's
        k, _, _ = cache_pair(shape, dtype, "contiguous", device)
        _, v, (base,) = cache_pair(shape, dtype, "middle_dims_swapped", device)
        return k, v, (k, base)
    raise AssertionError(layout)


def new_rows(sn, dtype, layout, device="cpu"):
    """Random (k_new, v_new) (B, Hkv, Sn, D) in ``layout``."""
    if layout == "contiguous":
        return tuple(torch.randn(B, HKV, sn, D, device=device).to(dtype) for _ in range(2))
    if layout == "rows_outer":  # flash-attn's (B, Sn, Hkv, D)
        return tuple(torch.randn(B, sn, HKV, D, device=device).to(dtype).transpose(1, 2) for _ in range(2))
    if layout == "heads_expanded":  # stride 0 over the kv heads
        return tuple(torch.randn(B, 1, sn, D, device=device).to(dtype).expand(B, HKV, sn, D) for _ in range(2))
    if layout == "keys_and_values_apart":
        return new_rows(sn, dtype, "contiguous", device)[0], new_rows(sn, dtype, "rows_outer", device)[1]
    raise AssertionError(layout)


def lengths_and_table(page, sn, capacity, max_blocks, device="cpu"):
    """Random lengths with 0, capacity - Sn and (paged) page - 1 among them: Sn > 1 rows cross a
    page boundary there; a random block table over a pool with spare blocks."""
    lens = torch.randint(0, capacity - sn + 1, (B,))
    lens[0], lens[1] = 0, capacity - sn
    if page is not None:
        lens[2] = page - 1
    table = None
    if page is not None:
        table = torch.randperm(B * max_blocks + 3)[: B * max_blocks].reshape(B, max_blocks).int().to(device)
    return lens.int().to(device), table


def run_both(page, sn, dtype, cache_layout="contiguous", new_layout="contiguous"):
    """The kernel's caches and storage, the torch ops', and the inputs."""
    shape, capacity, max_blocks = geometry(page)
    lens, table = lengths_and_table(page, sn, capacity, max_blocks)
    k_new, v_new = new_rows(sn, dtype, new_layout)
    got = cache_pair(shape, dtype, cache_layout)
    want = cache_pair(shape, dtype, cache_layout)
    append_kv_kernel(got[0], got[1], lens, k_new, v_new, table)
    append_kv_torch(want[0], want[1], lens, k_new, v_new, table)
    return got, want, (lens, k_new, v_new, table)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sn", [1, 5, 40])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_kernel_writes_what_the_torch_ops_and_the_definition_write(kind, sn, dtype):
    page = KINDS[kind]
    got, want, (lens, k_new, v_new, table) = run_both(page, sn, dtype)
    k_ref, v_ref = reference_append(*cache_pair(geometry(page)[0], dtype, "contiguous")[:2], lens, k_new, v_new, table)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), f"{kind} Sn={sn}: kernel vs torch ops"
    assert same_bits(got[0], k_ref) and same_bits(got[1], v_ref), f"{kind} Sn={sn}: kernel vs the definition"
    assert untouched(*got[2])
    written = B * HKV * sn * D
    assert int((~got[0].isnan()).sum()) == written and int((~got[1].isnan()).sum()) == written


@pytest.mark.parametrize(
    "cache_layout", ["middle_dims_swapped", "strided_head_dim", "one_buffer", "keys_and_values_apart"]
)
@pytest.mark.parametrize("kind", list(KINDS))
def test_caches_of_any_strides_and_only_their_rows_written(kind, cache_layout):
    """The whole storage behind the views compared: an element between them (the strided head
    dim's others, the interleaved other tensor) written by mistake shows."""
    got, want, _ = run_both(KINDS[kind], 5, torch.bfloat16, cache_layout)
    assert all(same_bits(g, w) for g, w in zip(got[2], want[2])), f"{kind} {cache_layout}"
    assert untouched(*got[2])


@pytest.mark.parametrize("new_layout", ["rows_outer", "heads_expanded", "keys_and_values_apart"])
@pytest.mark.parametrize("kind", ["dense", "paged16"])
def test_new_rows_of_any_strides(kind, new_layout):
    got, want, _ = run_both(KINDS[kind], 5, torch.float16, new_layout=new_layout)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.parametrize("kind", ["dense", "paged16"])
def test_row_blocks_past_the_grid_loop_in_their_programs(kind, monkeypatch):
    """Sn = 40 is two row blocks of 32 (D = 40: 64 padded); a grid of one row block loops."""
    monkeypatch.setattr(kv_append_launch, "MAX_GRID_YZ", 1)
    got, want, _ = run_both(KINDS[kind], 40, torch.float32)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.parametrize("kind", list(KINDS))
def test_lengths_and_block_table_read_through_their_strides(kind):
    page = KINDS[kind]
    shape, capacity, max_blocks = geometry(page)
    lens, table = lengths_and_table(page, 5, capacity, max_blocks)
    lens_strided = torch.zeros(2 * B, dtype=torch.int32)[::2].copy_(lens)
    table_strided = None if table is None else table.t().contiguous().t()  # column-major
    k_new, v_new = new_rows(5, torch.float32, "contiguous")
    got, want = cache_pair(shape, torch.float32, "contiguous"), cache_pair(shape, torch.float32, "contiguous")
    append_kv_kernel(got[0], got[1], lens_strided, k_new, v_new, table_strided)
    append_kv_torch(want[0], want[1], lens, k_new, v_new, table)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


def test_float64_and_a_head_dim_of_one():
    for d, dtype in ((40, torch.float64), (1, torch.bfloat16)):
        k_new, v_new = (torch.randn(B, HKV, 3, d).to(dtype) for _ in range(2))
        lens = torch.tensor([0, 7, 2, 5], dtype=torch.int32)
        got = cache_pair((B, HKV, 10, d), dtype, "contiguous")
        want = cache_pair((B, HKV, 10, d), dtype, "contiguous")
        append_kv_kernel(got[0], got[1], lens, k_new, v_new)
        append_kv_torch(want[0], want[1], lens, k_new, v_new)
        assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), f"D={d} {dtype}"


@pytest.mark.parametrize("kind", ["dense", "paged16"])
def test_rows_past_the_cache_or_its_blocks_are_skipped(kind):
    """Invalid positions (an input error validate=True reports) write nothing, anywhere: a length
    past capacity - Sn keeps its rows in range; a block entry out of range writes none of its rows."""
    page = KINDS[kind]
    shape, capacity, max_blocks = geometry(page)
    lens, table = lengths_and_table(page, 5, capacity, max_blocks)
    lens[3] = capacity - 2  # rows 0 and 1 fit, 2..4 are past the cache
    k_new, v_new = new_rows(5, torch.float32, "contiguous")
    got = cache_pair(shape, torch.float32, "contiguous")
    if table is not None:
        table[2, 0] = shape[0]  # lens[2] = page - 1: the row in block 0 is skipped, the 4 in block 1 written
    append_kv_kernel(got[0], got[1], lens, k_new, v_new, table)
    want = cache_pair(shape, torch.float32, "contiguous")
    # the torch ops one valid row at a time: all but sequence 3's last 3 and (paged) sequence 2's first
    for b in range(B):
        for i in range(5):
            if (b == 3 and i >= 2) or (table is not None and b == 2 and i == 0):
                continue
            one = (lens[b : b + 1] + i, k_new[b : b + 1, :, i : i + 1], v_new[b : b + 1, :, i : i + 1])
            if table is None:  # sequence b's own rows of the dense cache
                append_kv_torch(want[0][b : b + 1], want[1][b : b + 1], *one)
            else:
                append_kv_torch(want[0], want[1], *one, table[b : b + 1])
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


def test_nothing_to_write_launches_nothing(monkeypatch):
    launches = []
    monkeypatch.setattr(run, "launch_one", lambda *a, **k: launches.append(a[0]))
    k, v, _ = cache_pair((B, HKV, 8, D), torch.float16, "contiguous")
    empty = torch.empty(B, HKV, 0, D, dtype=torch.float16)
    append_kv_kernel(k, v, torch.zeros(B, dtype=torch.int32), empty, empty)
    no_room = torch.empty(B, HKV, 0, D, dtype=torch.float16)
    append_kv_kernel(no_room, no_room, torch.zeros(B, dtype=torch.int32), *new_rows(1, torch.float16, "contiguous"))
    assert launches == [] and k.isnan().all()


def test_append_kv_keeps_the_torch_ops_on_the_cpu(monkeypatch):
    """CPU tensors never reach the kernel (no Triton on the CPU in production), whatever the interpreter."""
    monkeypatch.setattr(run, "launch_one", lambda *a, **k: pytest.fail("append_kv launched a kernel on the CPU"))
    shape, capacity, max_blocks = geometry(16)
    lens, table = lengths_and_table(16, 5, capacity, max_blocks)
    k_new, v_new = new_rows(5, torch.bfloat16, "contiguous")
    got, want = cache_pair(shape, torch.bfloat16, "contiguous"), cache_pair(shape, torch.bfloat16, "contiguous")
    append_kv(got[0], got[1], lens, k_new, v_new, table)
    append_kv_torch(want[0], want[1], lens, k_new, v_new, table)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "paged16", "paged256"])
def test_gpu_one_launch_captured_and_replayed_with_new_lengths_and_tables(kind, monkeypatch):
    """append_kv on CUDA: one launch of the kernel; captured in a CUDA graph, then replayed with
    new rows, lengths and block tables copied in place, each replay writing what the torch ops do."""
    page = KINDS[kind]
    shape, capacity, max_blocks = geometry(page)
    launches, real = [], run.launch_one
    monkeypatch.setattr(run, "launch_one", lambda *a, **k: (launches.append(a[0]), real(*a, **k)))
    lens, table = lengths_and_table(page, 2, capacity, max_blocks, "cuda")
    k_new, v_new = new_rows(2, torch.bfloat16, "contiguous", "cuda")
    k_cache, v_cache, _ = cache_pair(shape, torch.bfloat16, "contiguous", "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        append_kv(k_cache, v_cache, lens, k_new, v_new, table)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert launches == [_kv_append], launches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_kv(k_cache, v_cache, lens, k_new, v_new, table)
    for step in range(3):
        new_lens, new_table = lengths_and_table(page, 2, capacity, max_blocks, "cuda")
        lens.copy_(new_lens.roll(step))
        if table is not None:
            table.copy_(new_table)
        for t in (k_new, v_new):
            t.copy_(torch.randn_like(t))
        for t in (k_cache, v_cache):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = cache_pair(shape, torch.bfloat16, "contiguous")
        cpu_table = None if table is None else table.cpu()
        append_kv_torch(want[0], want[1], lens.cpu(), k_new.cpu(), v_new.cpu(), cpu_table)
        assert same_bits(k_cache.cpu(), want[0]) and same_bits(v_cache.cpu(), want[1]), f"replay {step}"
