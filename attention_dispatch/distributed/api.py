"""context_parallel_sdpa(): ad.sdpa() over a sequence sharded across the ranks of a group.

Each rank holds its queries, keys and values at the global positions of the layout
(layout.py), computes its queries against every rank's keys block by block with ad.sdpa(...,
return_lse=True) (blocks.py says what each block computes and skips blocks outside the causal or
window band; steps.py runs them), and merges the blocks by their logsumexp (merge.py). The keys
and values travel by a ring of batch_isend_irecv steps or one all-gather (exchange.py). Backward:
"merged" (merged.py: each block's backend's backward from the merged output and logsumexp, the
keys sent round again with their gradients), "recompute" (recompute.py: recomputes each block
and its merge weights) or "autograd" (differentiable exchanges, every block's graph kept).
This module validates the call, checks that the ranks agree, and puts the pieces together.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import numbers
import threading
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import dispatch, registry
from ..api import explain
from ..caches import register_cache
from ..autocast import autocast_inputs
from ..call import check_plain_tensor, has_tangent
from ..config import current_config
from ..dispatch import NoBackendError
from ..dropout_stream import draw_seed
from ..features import check_alibi_slopes, check_return_lse, check_sinks, check_softcap, lse_dtype
from ..semantics import band as fold_band
from ..semantics import normalize_causal, normalize_window
from ..torch_private import forward_ad, functorch_wrapped
from . import exchange as _exchange
from .blocks import Band, Documents
from .layout import check_layout, chunks_per_rank
from .merge import apply_sinks
from .merged import merged_attention
from .recompute import recomputed_attention
from .steps import Setup, run_forward

# Whether a call with facts not yet checked in its group all-gathers them (one small collective:
# a host sync on GPUs).
_CHECK_ACROSS_RANKS = contextvars.ContextVar("attention_dispatch_cp_check_across_ranks", default=True)
# Per group, the facts every rank passed alike, oldest first: a call repeating them skips the
# all-gather. Per group, so that its members evict alike (they call alike in it); weak, so that a
# destroyed group's entries go with it.
_CHECKED_PER_GROUP = 64
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_checked_lock = threading.Lock()


def _clear_checked() -> None:
    with _checked_lock:
        _checked.clear()


register_cache("distributed.checked_facts", _clear_checked, lambda: sum(len(c) for c in list(_checked.values())))

EXCHANGES = ("ring", "allgather")
BACKWARDS = ("merged", "recompute", "autograd")


class BackwardChoice(NamedTuple):
    """A call's backward mode and why (last_backward())."""

    mode: str
    reason: str


_last_choice: contextvars.ContextVar[BackwardChoice | None] = contextvars.ContextVar(
    "attention_dispatch_cp_last_backward", default=None
)


def last_backward() -> BackwardChoice | None:
    """The backward mode of this context's latest context_parallel_sdpa() call and why (None before any)."""
    return _last_choice.get()


def default_backward(world: int) -> str:
    """backward=None's mode where "merged" does not serve the call: "autograd" on 1 or 2 ranks, where it holds one other rank's keys
    (as the recomputing backward does while they pass) and measured faster with less memory
    (2 H100s, causal zigzag ring, 64k and 128k: 1.20-1.25x, peak 2.9 / 5.5 GiB against 3.4 /
    6.5); "recompute" on more, where "autograd" would keep every rank's keys (O(S) per rank)
    and send its backward's gradients unhidden (not measured)."""
    return "autograd" if world <= 2 else "recompute"


def _check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1], got {type(dropout_p).__name__}")
    if not 0 <= dropout_p <= 1:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1]")
    return float(dropout_p)


def _dropout_backends(forced, key_segment: int) -> tuple[str, ...]:
    """The candidate backends (in the call's order) that draw dropout at a block's global
    position (Capabilities.dropout_positions) at column offsets that are multiples of
    ``key_segment`` (the layout's key segment: every block's first key); raise if there is none."""
    names, source = dispatch.candidate_order(forced, current_config())
    known = set(registry.list_backends())

    def draws(name: str) -> bool:
        caps = registry.find_backend(name).capabilities
        return caps.dropout_positions and key_segment % caps.dropout_column_multiple == 0

    able = tuple(n for n in names if n in known and draws(n))
    if not able:
        allowed = [n for n in registry.list_backends() if draws(n)]
        raise ValueError(
            f"dropout_p > 0: no candidate backend ({', '.join(names)}, from {source}) draws the dropout mask "
            f"at a block's global position (Capabilities.dropout_positions) at column offsets that are "
            f"multiples of the layout's key segment ({key_segment} keys; Capabilities.dropout_column_multiple), "
            f"which makes the blocks one sdpa() call's dropout; backends that do: {', '.join(allowed) or 'none'}"
        )
    return able


def _merged_backends(setup: Setup, forced) -> tuple[tuple[str, ...], str]:
    """(the candidate backends, in the call's order, that run a block's backward from the merged
    output: Capabilities.backward_from_output, and dropout_positions with dropout; '') or ((), why
    backward="merged" cannot serve the call)."""
    mask = setup.mask
    if mask is not None and mask.is_floating_point() and mask.requires_grad and torch.is_grad_enabled():
        return (), "attn_mask requires grad: a backward from the merged output gives no mask gradient"
    names, source = dispatch.candidate_order(forced, current_config())
    known = set(registry.list_backends())
    able = tuple(n for n in names if n in known and registry.find_backend(n).capabilities.backward_from_output)
    if setup.dropout_backends is not None:
        able = tuple(n for n in able if n in setup.dropout_backends)
    if not able:
        dropout = " and draws dropout at block positions" if setup.dropout_backends is not None else ""
        return (), (
            f"no candidate backend ({', '.join(names)}, from {source}) declares "
            f"Capabilities.backward_from_output{dropout}"
        )
    return able, ""


def _choose_backward(setup: Setup, asked, forced, probe) -> BackwardChoice:
    """backward=None: "merged" where it serves the call (merged.py: the blocks' backward from the
    merged output, no per-block merge passes), else default_backward(); a mode asked for is
    taken, "merged" raising where it cannot serve. ``probe(backends)``: whether a block of the
    call has a backend among them (ad.explain)."""
    if asked in ("recompute", "autograd"):
        return BackwardChoice(asked, "backward= argument")
    grads = (setup.q, setup.k, setup.v, setup.mask, setup.sinks)
    if asked is None and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grads)):
        mode = default_backward(setup.world)  # the candidates unrestricted: inference may take any backend
        return BackwardChoice(mode, f"no input requires grad; {mode} on {setup.world} rank(s) (default_backward)")
    able, why = _merged_backends(setup, forced)
    if not why and not probe(able):
        why = f"no backend declaring Capabilities.backward_from_output ({', '.join(able)}) serves the blocks"
    if not why:
        setup.backward_backends = able
        if setup.dropout_backends is not None:  # the blocks' dropout scope: the same backends
            setup.dropout_backends = able
        return BackwardChoice("merged", f"the blocks' backward from the merged output on {', '.join(able)}")
    if asked == "merged":
        raise ValueError(f"backward='merged' cannot serve this call: {why}; use backward='autograd' or 'recompute'")
    mode = default_backward(setup.world)
    return BackwardChoice(mode, f"not merged: {why}; {mode} on {setup.world} rank(s) (default_backward)")


def _offsets(cu, name: str, total: int) -> list[int]:
    """Global varlen offsets as a list, checked: int32, 1-D, from 0, non-decreasing, ending at total."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        what = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be an int32 1-D tensor of B + 1 >= 2 offsets, got {what}")
    values = cu.tolist()
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] != total:
        raise ValueError(
            f"{name}={values} must start at 0, never decrease and end at the global packed length {total} "
            "(context parallelism: the offsets are over the whole sequence, the same on every rank)"
        )
    return values


def _check_mask(attn_mask, b: int, hq: int, sq_local: int, sk_total: int):
    """A bias/mask in this rank's layout: rows of its queries, all key columns in global order."""
    if attn_mask is None:
        return None
    check_plain_tensor(attn_mask, "attn_mask")
    shape = tuple(attn_mask.shape)
    expected = (b, hq, sq_local, sk_total)
    padded = (1,) * (4 - len(shape)) + shape if len(shape) <= 4 else None
    if padded is None or any(got not in (1, want) for got, want in zip(padded, expected)):
        raise ValueError(
            f"attn_mask of shape {shape}; context_parallel_sdpa takes each rank's rows of the whole mask: "
            f"broadcastable to (B, Hq, S_local_q, S_total_k) = {expected} (rows: this rank's queries in the "
            "layout's order, e.g. layout.shard(mask, group, layout, dim=-2); columns: every key in global order)"
        )
    return attn_mask.reshape(padded)


def _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, options) -> Setup:
    """Every check that needs no other rank, before any communication."""
    exchange, layout, group = options["exchange"], options["layout"], options["group"]
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} is not allowed; use one of {', '.join(map(repr, EXCHANGES))}")
    if options["backward"] is not None and options["backward"] not in BACKWARDS:
        raise ValueError(
            f"backward={options['backward']!r} is not allowed; use None (the default: by the group's "
            f"size) or one of {', '.join(map(repr, BACKWARDS))}"
        )
    check_layout(layout)
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_plain_tensor(t, name)
        if functorch_wrapped(t):
            raise TypeError(
                f"{name} is a tensor of a torch.func transform (vmap, grad, jvp): context_parallel_sdpa's "
                "exchanges between ranks take plain tensors; call it outside the transform"
            )
    if forward_ad._current_level >= 0 and has_tangent(query, key, value, attn_mask, options["sinks"]):
        raise TypeError(
            "context_parallel_sdpa: forward-mode AD (a dual tensor among the inputs) is not supported: the "
            "exchanges between ranks carry no tangent (ad.sdpa(backend='math') computes one on one device)"
        )
    dropout_p = _check_dropout(dropout_p)
    rank, world = _exchange.check_group(group, query.device)
    causal = normalize_causal(is_causal, options["causal"])
    window = normalize_window(options["window"])
    softcap = check_softcap(options["softcap"])
    return_lse = check_return_lse(options["return_lse"])
    cu_q, cu_k = options["cu_seqlens_q"], options["cu_seqlens_k"]
    packed = cu_q is not None or cu_k is not None
    setup = Setup()
    setup.backward_backends = ()
    setup.dropout_p, setup.dropout_seed, setup.dropout_backends = dropout_p, None, None
    if dropout_p > 0:
        if packed:
            raise ValueError(
                f"dropout_p={dropout_p} with cu_seqlens: one varlen call's dropout is keyed by (document, "
                "position in it), which the context-parallel blocks (dense, several documents) cannot "
                "reproduce; use dropout_p=0.0 or dense shards"
            )
    if packed:
        if cu_q is None or cu_k is None:
            raise ValueError("varlen needs both cu_seqlens_q and cu_seqlens_k (global offsets), got only one")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 3:
                raise ValueError(f"{name} of shape {tuple(t.shape)}; varlen takes packed (S_local, H, D) shards")
        if attn_mask is not None:
            raise ValueError(
                "attn_mask with cu_seqlens: context_parallel_sdpa takes no mask for packed documents "
                "(their boundaries are the mask); pass dense (B, H, S_local, D) shards for a bias"
            )
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    else:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(
                    f"{name} of shape {tuple(t.shape)}; context_parallel_sdpa takes (B, H, S_local, D) shards "
                    "(or packed (S_local, H, D) with cu_seqlens_q/k)"
                )
        q, k, v = query, key, value
    b, hq, sq_local = q.shape[:3]
    sq, sk = sq_local * world, k.shape[2] * world
    setup.mask = _check_mask(attn_mask, b, hq, sq_local, sk)
    if dropout_p > 0:  # blocks start at the layout's segments (check_layout: divisible checked later)
        key_segment = sk // (2 * world if layout == "zigzag" else world)
        setup.dropout_backends = _dropout_backends(options["backend"], key_segment)
    setup.sinks = check_sinks(options["sinks"], hq, query)
    bottom_right, left, right = fold_band(causal, window)
    setup.band = Band(sk - sq if bottom_right else 0, left, right)
    setup.docs = None
    if packed:
        offsets_q, offsets_k = _offsets(cu_q, "cu_seqlens_q", sq), _offsets(cu_k, "cu_seqlens_k", sk)
        if len(offsets_q) != len(offsets_k):
            raise ValueError(
                f"cu_seqlens_q has {len(offsets_q)} offsets but cu_seqlens_k {len(offsets_k)}; one per document + 1"
            )
        setup.docs = Documents(offsets_q, offsets_k, bottom_right)
    documents = b if not packed else len(cu_q) - 1  # ALiBi slopes: (Hq,) or one row per sequence
    slopes = check_alibi_slopes(options["alibi_slopes"], documents, hq, (documents,), query)
    setup.sdpa_args = dict(
        scale=scale,
        enable_gqa=enable_gqa,
        backend=options["backend"],
        deterministic=options["deterministic"],
        softcap=softcap,
    )
    # the blocks' arguments, checked once on the local shards (types, shapes, a backend that serves them)
    probe_mask = None if setup.mask is None else setup.mask[..., : k.shape[2]]
    if slopes is not None and probe_mask is None:
        probe_mask = torch.zeros((), dtype=lse_dtype(query.dtype), device=query.device).expand(1, 1, 1, 1)
    setup.q, setup.k, setup.v, setup.packed, setup.slopes = q, k, v, packed, slopes
    setup.rank, setup.world, setup.group, setup.layout, setup.exchange = rank, world, group, layout, exchange
    setup.sq, setup.sk, setup.return_lse = sq, sk, return_lse
    decisions = {}

    def probe(backends):
        """The blocks' decision among ``backends`` (all candidates: None; dropout: theirs)."""
        if backends not in decisions:
            scoped = backends or setup.dropout_backends
            with dispatch.use_backends(*scoped) if scoped else contextlib.nullcontext():
                decisions[backends] = explain(
                    q, k, v, probe_mask, dropout_p, causal=causal, window=window, return_lse=True, **setup.sdpa_args
                )
        return decisions[backends].backend is not None

    choice = _choose_backward(setup, options["backward"], options["backend"], probe)
    setup.backward, setup.backward_reason = choice
    _last_choice.set(choice)
    probe(setup.backward_backends)
    decision = decisions[setup.backward_backends]
    if decision.backend is None:
        raise NoBackendError(f"no backend computes a block of this call with return_lse=True:\n{decision}", decision)
    return setup


def _facts(setup: Setup, options) -> dict[str, tuple[int, ...]]:
    """What must agree across ranks, as ints (shapes, dtypes, grads, options, offsets)."""

    def shape(t, n=4):
        return (-1,) * n if t is None else tuple(t.shape) + (0,) * (n - t.dim())

    cu = [None if options[n] is None else options[n].tolist() for n in ("cu_seqlens_q", "cu_seqlens_k")]
    return {
        "query shape": shape(setup.q),
        "key shape": shape(setup.k),
        "value shape": shape(setup.v),
        "attn_mask shape": shape(setup.mask),
        "dtypes": tuple(_exchange.fingerprint(getattr(t, "dtype", None)) for t in (setup.q, setup.k, setup.mask)),
        "requires_grad (query, key, value, attn_mask, sinks)": tuple(
            int(t is not None and t.requires_grad and torch.is_grad_enabled())
            for t in (setup.q, setup.k, setup.v, setup.mask, setup.sinks)
        ),
        "options (causal, window, scale, ...)": (
            _exchange.fingerprint((tuple(setup.band), sorted(setup.sdpa_args.items()), setup.return_lse)),
        ),
        "layout, exchange, backward, dropout_p": (
            _exchange.fingerprint((setup.layout, setup.exchange, setup.backward, setup.dropout_p)),
        ),
        "alibi_slopes, sinks given": (int(setup.slopes is not None), int(setup.sinks is not None)),
        "cu_seqlens_q/k": (_exchange.fingerprint(cu),),
    }


@contextlib.contextmanager
def cross_rank_checks(enabled: bool):
    """Within the block, context_parallel_sdpa checks (True, the default) or skips (False) that
    every rank passed the same shapes and options: one small all-gather (a host sync on GPUs) the
    first time a group sees a call's shapes, dtypes and options; repeats are not checked again
    (so a training loop's later steps sync nothing). Skip it where every rank is known to call
    alike; set it alike on every rank. Scoped to the current context (thread / task)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"cross_rank_checks(enabled) takes a bool, got {type(enabled).__name__}")
    token = _CHECK_ACROSS_RANKS.set(enabled)
    try:
        yield
    finally:
        _CHECK_ACROSS_RANKS.reset(token)


def _check_across_ranks(setup: Setup, options) -> None:
    """One small all_gather of each rank's facts, the first time the group sees them; every rank
    raises the same error on a mismatch. Facts every rank passed alike are remembered per group
    (clear_cache() forgets them: call it on every rank alike), so a repeat skips the all-gather:
    a rank repeating a checked call while another passes new facts waits for the group's timeout
    instead of raising. The layout's divisibility is checked on the local lengths either way."""
    if _CHECK_ACROSS_RANKS.get():
        facts = _facts(setup, options)
        pg = dist.group.WORLD if setup.group is None else setup.group
        signature = tuple(facts.values())
        with _checked_lock:
            seen = _checked.setdefault(pg, collections.OrderedDict())
            if signature in seen:
                seen = None
        if seen is not None:
            every = _exchange.gather_facts(facts, setup.group, setup.q.device)
            for name in facts:
                values = [row[name] for row in every]
                if any(v != values[0] for v in values):
                    listed = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                    raise ValueError(
                        f"{name} differs across the ranks of the group ({listed}); every rank must pass the same"
                    )
            with _checked_lock:
                seen[signature] = None
                if len(seen) > _CHECKED_PER_GROUP:  # the oldest first: every member evicts alike
                    seen.popitem(last=False)
    parts = chunks_per_rank(setup.layout)
    for name, local in (("query", setup.q.shape[2]), ("key", setup.k.shape[2])):
        if local % parts:
            raise ValueError(
                f"{name}: local sequence length {local} is not divisible by {parts}: layout={setup.layout!r} "
                f"holds {parts} equal chunks per rank (the global length {local * setup.world} must be "
                f"divisible by {parts * setup.world})"
            )


def context_parallel_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    group=None,
    exchange="ring",
    layout="zigzag",
    backward=None,
    causal=None,
    window=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    backend=None,
    deterministic=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
):
    """ad.sdpa() over a sequence sharded across the ranks of ``group`` (default: the world).

    Each rank passes its shard in ``layout`` (layout.shard() makes it): query (B, Hq, S_local_q, D),
    key/value (B, Hkv, S_local_k, D), and gets its shard of the output (B, Hq, S_local_q, Dv),
    equal to ad.sdpa() on the whole sequences, forward and backward. Varlen: packed
    (S_local, H, D) shards with cu_seqlens_q/k over the whole packed sequence (documents may span
    ranks); output (S_local, Hq, Dv). attn_mask (bool or float, may require grad): this rank's
    query rows of the whole mask, every key column in global order, broadcastable to
    (B, Hq, S_local_q, S_total_k). causal/window/ALiBi refer to global positions. ``exchange``:
    "ring" (W - 1 batch_isend_irecv steps) or "allgather". ``backward``: "merged" (each
    block's backward from the merged output on a backend declaring
    Capabilities.backward_from_output; the keys go round again with their gradients, so no rank
    keeps others' keys; no mask gradient), "recompute" (recomputes each block, the keys going
    round again), "autograd" (keeps every block's graph and every received key block) or None
    (default): "merged" where it serves the call, else "autograd" on up to 2 ranks, else
    "recompute" (last_backward() says which and why). With return_lse, also this rank's
    logsumexp (B, Hq, S_local_q) (varlen (Hq, S_local)), without the sinks. Dropout (dense
    shards; a backend declaring Capabilities.dropout_positions): each block draws its part of
    one sdpa() call's keep-mask, seeded as sdpa() seeds it (rank 0's draw).
    Every rank must call it with the same shapes and options, and backpropagate through its output.
    """
    del max_seqlen_q, max_seqlen_k  # the blocks' lengths come from the offsets themselves
    options = dict(
        group=group,
        exchange=exchange,
        layout=layout,
        backward=backward,
        causal=causal,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        backend=backend,
        deterministic=deterministic,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        return_lse=return_lse,
    )
    cast = autocast_inputs(query, key, value, attn_mask)
    if cast is None:
        return _sharded_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, options)
    with torch.autocast(query.device.type, enabled=False):  # as ad.sdpa(): the inputs as F.sdpa gets them
        return _sharded_call(*cast, dropout_p, is_causal, scale, enable_gqa, options)


def _sharded_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, options):
    """context_parallel_sdpa() on its normalised ``options`` (the group's and sdpa()'s keyword arguments)."""
    setup = _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, options)
    _check_across_ranks(setup, options)
    if setup.dropout_p > 0:  # one seed per call, as sdpa() draws it; rank 0's, so that all agree
        setup.dropout_seed = _exchange.broadcast_seed(draw_seed(setup.q.device), setup.group)
    if setup.backward == "recompute":
        out, lse = recomputed_attention(setup, setup.q, setup.k, setup.v, setup.mask)
        unused = []
    elif setup.backward == "merged":
        out, lse = merged_attention(setup, setup.q, setup.k, setup.v, setup.mask)
        unused = []
    else:
        # merged straight into the inputs' dtype unless the sinks still scale it (one rounding either way)
        out_dtype = setup.q.dtype if setup.sinks is None else None
        out, lse, unused = run_forward(setup, setup.q, setup.k, setup.v, setup.mask, True, out_dtype)
    if setup.sinks is not None:
        out = apply_sinks(out, lse, setup.sinks)
    # autograd mode: every exchanged tensor stays in the graph, so every rank runs every exchange's
    # backward (recompute mode's one Function does its own communication)
    anchored = unused if setup.backward == "autograd" else []
    out = _exchange.anchor(out.to(setup.q.dtype), anchored)
    if setup.packed:
        out = out[0].transpose(0, 1)
    if not setup.return_lse:
        return out
    lse = _exchange.anchor(lse, anchored)
    return out, (lse[0] if setup.packed else lse)
