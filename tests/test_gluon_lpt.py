"""The causal Gluon forward's LPT launch groups (gluon.launch.lpt_rows): their K/V fill at most
LPT_L2_SHARE of L2 (E102: groups sized to the whole L2 re-read K/V from HBM at d256 S=512).
CPU: the group sizes; GPU (marked gpu): every group size gives the grid order's output."""

from types import SimpleNamespace

import pytest
import torch

from attention_dispatch.kernels import KernelParams, describe_route, entry, triton_attention
from attention_dispatch.kernels.gluon import launch
from attention_dispatch.kernels.gluon import route as gluon_route

H100_L2 = 50 * 2**20
CAUSAL = KernelParams(scale=0.1, window_left=-1, window_right=0)


def _rows(monkeypatch, S, D, group=1, params=CAUSAL, bias=None, l2=H100_L2, n_m_blocks=64, sms=132):
    monkeypatch.setattr(launch, "l2_bytes", lambda device: l2)
    monkeypatch.setattr(launch, "device_info", lambda device: ((9, 0), 232448, sms))
    prob = SimpleNamespace(Sk=S, Dqk=D, Dv=D, group=group)
    return launch.lpt_rows(params, prob, bias, torch.empty(0, dtype=torch.bfloat16), n_m_blocks)


@pytest.mark.parametrize(
    "S, D, rows",
    [(512, 256, 32), (2048, 128, 16), (4096, 128, 8), (16384, 128, 2), (1 << 20, 128, 1)],
)
def test_lpt_group_kv_fills_at_most_its_share_of_l2(monkeypatch, S, D, rows):
    got = _rows(monkeypatch, S, D)
    assert got == rows
    assert got == 1 or got * S * 2 * D * 2 <= launch.LPT_L2_SHARE * H100_L2


def test_lpt_group_counts_query_heads_of_its_kv_heads(monkeypatch):
    assert _rows(monkeypatch, 2048, 128, group=4) == 16 * 4


def test_lpt_group_takes_the_whole_l2_where_its_programs_fit_one_wave(monkeypatch):
    """Chunked prefill (B4, Hq 32 / Hkv 8, 512 new tokens over 8k: 4 query blocks a row): 8 kv heads'
    K/V (35.7 MB) fill 71% of the L2 and their 128 programs run in one wave of 132 SMs, so the group
    is FA4's section; in the greedy dispatch model the busiest SM runs 266 tile steps, not 268."""
    S = 8192 + 512
    assert _rows(monkeypatch, S, 128, group=4, n_m_blocks=4) == 32
    assert _rows(monkeypatch, S, 128, group=4, n_m_blocks=4, sms=100) == 16  # 128 programs: two waves
    assert _rows(monkeypatch, S, 128, group=4, n_m_blocks=8) == 16
    assert _rows(monkeypatch, 1 << 20, 128, group=4, n_m_blocks=1) == 4  # one kv head past the L2 fits none


def _busiest_sm(rows, n_m, group_rows, tiles, sms=132):
    """Greedy in-order dispatch (gluon.common._query_block's order) of whole programs on ``sms``."""
    loads = [0] * sms
    for pid in range(rows * n_m):
        g, r = divmod(pid, group_rows * n_m)
        width = min(group_rows, rows - g * group_rows)
        m = n_m - 1 - r // width
        loads[loads.index(min(loads))] += tiles(m)
    return max(loads)


def test_the_whole_l2_group_evens_chunked_prefills_last_wave(monkeypatch):
    half, whole = 16, _rows(monkeypatch, 8704, 128, group=4, n_m_blocks=4)
    assert (_busiest_sm(128, 4, half, lambda m: 65 + m), _busiest_sm(128, 4, whole, lambda m: 65 + m)) == (268, 266)


def test_lpt_only_for_causal_without_bias(monkeypatch):
    assert _rows(monkeypatch, 512, 256, params=KernelParams(scale=0.1)) == 0
    assert _rows(monkeypatch, 512, 256, params=KernelParams(scale=0.1, window_left=256, window_right=0)) == 0
    assert _rows(monkeypatch, 512, 256, bias=object()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_every_lpt_group_size_gives_the_grid_orders_output(monkeypatch, d):
    """The causal Gluon forward of 15 (b, h) rows x 8 query blocks in groups of 1, 3 (the last one
    short), 16 (wider than the call) and as shipped: output and logsumexp bit-equal to the grid's
    order (each (query block, row) computed once, by the same code, wherever it lands)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    if gluon_route.gluon_reason() is not None:
        pytest.skip(gluon_route.gluon_reason())
    monkeypatch.setattr(gluon_route, "WS_MIN_WORK", 0)  # small shapes: the route, not its threshold
    q, k, v = (torch.randn(3, 5, 1024, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    params = KernelParams(scale=d**-0.5, window_left=-1, window_right=0)
    assert describe_route(q, k, v, None, params, need_lse=True)[0][1] == entry.GLUON
    shipped, results = launch.lpt_rows, {}
    for n in (0, 1, 3, 16, "shipped"):
        monkeypatch.setattr(launch, "lpt_rows", shipped if n == "shipped" else (lambda *args, n=n: n))
        with torch.no_grad():
            results[n] = triton_attention(q, k, v, None, params, return_lse=True)
    for n, (out, lse) in results.items():
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1]), n
