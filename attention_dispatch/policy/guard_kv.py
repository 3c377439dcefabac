"""The numerics guard for sdpa_with_kvcache(): the same rows-against-float64 check as
guard.py, where each sequence b attends to its first L_b keys of the cache (L_b = cache_seqlens[b],
plus Sq once k_new/v_new were appended), causal and window aligned bottom-right to L_b."""

from __future__ import annotations

import torch

from ..backends.math import _cache_rows
from ..semantics import band
from . import guard

_KV_OPTIONS = frozenset({"k_new", "v_new", "block_table", "causal", "window", "scale"})


def judgeable(options: dict) -> bool:
    """Calls with options the guard does not compute (softcap, ALiBi, sinks, lse) are not judged."""
    return all(name in _KV_OPTIONS for name in options)


def _gather(problem, picks, query, k_cache, v_cache, lengths, options, out):
    sq, group = query.shape[2], problem.heads_q // max(problem.heads_kv, 1)
    _, left, right = band(options["causal"], options["window"])
    block_table = options["block_table"]
    width = max(lengths[b] for b, *_ in picks)
    n, dev = len(picks), query.device
    allowed = torch.zeros(n, width, dtype=torch.bool, device=dev)
    qs, ks, vs, got = [], [], [], []
    for r, (b, h, i) in enumerate(picks):
        length = lengths[b]
        qs.append(query[b, h, i])
        got.append(out[b, h, i])
        for cache, rows in ((k_cache, ks), (v_cache, vs)):
            keys = _cache_rows(cache, b, length, block_table)[h // group]
            rows.append(torch.nn.functional.pad(keys, (0, 0, 0, width - length)))
        diag = i + length - sq
        lo, hi = (diag - left if left >= 0 else 0), (diag + right if right >= 0 else length - 1)
        allowed[r, max(lo, 0) : max(min(hi, length - 1) + 1, 0)] = True
    return torch.stack(qs), torch.stack(ks), torch.stack(vs), allowed, torch.stack(got)


def check(problem, call, out, rows: int = 8, factor: float = 2.0) -> guard.Mismatch | None:
    """guard.check for a KvCall (kvcache.normalize_kvcache) and the output its backend gave."""
    options, query = call.options, call.query
    b, hq, sq, _ = query.shape
    if not judgeable(options) or 0 in (b, hq, sq):
        return None
    lengths = call.cache_seqlens.tolist()
    if options["k_new"] is not None:
        lengths = [n + sq for n in lengths]
    total = b * hq * sq
    flat = guard._rng.sample(range(total), min(rows, total))
    picks = [(f // (hq * sq), f // sq % hq, f % sq) for f in flat]
    picks = [p for p in picks if lengths[p[0]] > 0] or None
    if picks is None:
        return None
    error = base = 0.0
    with torch.no_grad():
        for start in range(0, len(picks), 4):  # a few rows at a time: a cache can be long
            chunk = picks[start : start + 4]
            q, k, v, allowed, got = _gather(problem, chunk, query, call.k_cache, call.v_cache, lengths, options, out)
            ref = guard._reference(q, k, v, allowed, None, options["scale"])
            low = guard._rows_in(query.dtype, q, k, v, None, allowed, options["scale"])
            base = max(base, guard._max_err(low.double(), ref))
            error = max(error, guard._max_err(got.double(), ref))
    return guard._verdict(picks, error, base, query.dtype, factor)


def guard_kv_call(decision, call, out, cfg, rerun):
    """sdpa_with_kvcache()'s full path after the chosen backend ran: as guard.guard_call (the
    rerun appends k_new/v_new again at the same positions: the same cache)."""
    problem, wrong = call.problem, []
    while guard._due(decision.backend, problem, cfg):
        name = decision.backend
        found = check(problem, call, out, cfg.rows, cfg.factor)
        reason = guard._mismatch(name, problem, found, "max error", cfg)
        if reason is None:
            break
        wrong.append(name)
        decision, out = rerun()
        if decision.backend in wrong:
            raise guard.GuardError(f"numerics guard: backend {decision.backend!r} chosen again after its quarantine")
        decision = guard._noted(decision, name, reason)
    return decision, out
