"""The numerics guard for sdpa_with_kvcache(): the same rows-against-float64 check as
guard.py, where each sequence b attends to its first L_b keys of the cache (L_b = cache_seqlens[b],
plus Sq once k_new/v_new were appended), causal and window aligned bottom-right to L_b."""

from __future__ import annotations

import torch

from ..backends.math import _cache_rows
from ..semantics import band
from . import guard
from .guard_rows import Rows, _features, feature_rows, measure

_KV_OPTIONS = frozenset(
    {"k_new", "v_new", "block_table", "causal", "window", "scale", "softcap", "alibi_slopes", "sinks", "return_lse"}
)


def judgeable(options: dict) -> bool:
    """Calls with options the guard does not compute (a feature added after it) are not judged."""
    return all(name in _KV_OPTIONS for name in options)


def _gather(problem, picks, query, k_cache, v_cache, lengths, options, out, lse) -> Rows:
    sq, group = query.shape[2], problem.heads_q // max(problem.heads_kv, 1)
    _, left, right = band(options["causal"], options["window"])
    block_table = options["block_table"]
    width = max(lengths[b] for b, *_ in picks)
    n, dev = len(picks), query.device
    allowed = torch.zeros(n, width, dtype=torch.bool, device=dev)
    qs, ks, vs, got, diags = [], [], [], [], []
    for r, (b, h, i) in enumerate(picks):
        length = lengths[b]
        qs.append(query[b, h, i])
        got.append(out[b, h, i])
        for cache, rows in ((k_cache, ks), (v_cache, vs)):
            keys = _cache_rows(cache, b, length, block_table)[h // group]
            rows.append(torch.nn.functional.pad(keys, (0, 0, 0, width - length)))
        diag = i + length - sq
        diags.append(diag)
        lo, hi = (diag - left if left >= 0 else 0), (diag + right if right >= 0 else length - 1)
        allowed[r, max(lo, 0) : max(min(hi, length - 1) + 1, 0)] = True
    b, h, i = (torch.tensor([p[k] for p in picks], device=dev) for k in range(3))
    fields = dict(q=torch.stack(qs), k=torch.stack(ks), v=torch.stack(vs), allowed=allowed, bias=None)
    fields |= dict(slope=None, distance=None, sinks=None, got=torch.stack(got))
    diag = torch.tensor(diags, device=dev)[:, None]
    j = torch.arange(width, device=dev)
    gathered = {name: source[index] for name, (source, index) in feature_rows(options, b, h).items()}
    _features(fields, dict(options, dropout_p=0.0), gathered, diag, j, None, None if lse is None else lse[b, h, i])
    return Rows(**fields)


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
    out, lse = out if options.get("return_lse") else (out, None)
    scale, softcap, dtype = options["scale"], options.get("softcap"), query.dtype
    gather = (call.k_cache, call.v_cache, lengths, options, out, lse)
    chunks = (
        _gather(problem, picks[s : s + 4], query, *gather) for s in range(0, len(picks), 4)
    )  # a cache can be long
    stats = measure(chunks, scale, softcap, dtype, lse is not None)
    where = [x for column in zip(*picks) for x in column]
    return guard._read(stats.tolist() + where, dtype, factor, lse is not None)


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
