"""sdpa() under torch.compile: the decision is taken once while dynamo traces the call, outside
the graph, so the graph holds only the chosen backend's ops.  torch._dynamo is never imported
here (about 3 s, half of ``import attention_dispatch``).

A sequence length that dynamo traces symbolically (``torch._dynamo.mark_dynamic``,
``dynamic=True``, or a shape that changed) stays symbolic: the decision is taken for the size
at hand and proven the same for a span of lengths (dispatch.length_span, the proof sdpa()'s
decode reuse runs), and the graph guards that span, so every length in it runs the one graph
and a length outside it traces again.  Any other symbolic size is specialised (a guard on its
value: a new value traces again)."""

from __future__ import annotations

import dataclasses
import operator

import torch

from . import dispatch
from .call import CallFacts, make_problem
from .debug import note_decision

LONGEST = 1 << 62  # the top of a span: no length reaches it


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without its import of torch._dynamo: that
    decorator only marks the function (torch 2.4 .. 2.13), and dynamo reads the mark when it
    traces a call (tests/test_compile.py fails should a release change this)."""
    fn._dynamo_marked_constant = True
    return fn


def decide_while_tracing(facts: CallFacts, forced) -> tuple:
    """(backend name, deterministic) for a call dynamo is tracing.  Traced code: dynamo runs
    each line symbolically, so a comparison of a symbolic size here becomes a guard."""
    from torch.fx.experimental import symbolic_shapes as shapes  # loaded by dynamo already

    hint = getattr(shapes, "optimization_hint", None)  # torch >= 2.13: a size's value, no guard
    length, fields, mask_dims = None, (), ()
    if hint is not None and facts.layout == "dense":
        dynamic = tuple(f for f in ("seqlen_q", "seqlen_k") if not shapes.has_static_value(getattr(facts, f)))
        # Sq and Sk: one symbol, or guarded equal where they are (self-attention: they always
        # are); two different lengths would need two spans, so both are specialised
        if len(dynamic) == 1 or (len(dynamic) == 2 and facts.seqlen_q == facts.seqlen_k):
            length, fields = getattr(facts, dynamic[0]), dynamic
    if length is not None and facts.mask_shape is not None:
        mask_dims = tuple(
            i
            for i, n in enumerate(facts.mask_shape)
            if not shapes.has_static_value(n) and n == length  # a guard, as Sq == Sk
        )
    values = []
    for name, fact in zip(CallFacts._fields, facts):
        if name in fields:
            values.append(hint(length))
        elif name == "mask_shape" and mask_dims:
            values.append(tuple(hint(n) if i in mask_dims else _constant(n) for i, n in enumerate(fact)))
        else:
            values.append(_constant(fact))
    name, deterministic, span = _decide_at_trace_time(tuple(values), forced, fields, mask_dims)
    if length is not None:
        if span is None:
            _constant(length)  # proven for this length only: specialise it (mark_dynamic refuses)
        else:  # guards: a length outside the proven span traces again
            if span[0] > 2 and length < span[0]:
                raise AssertionError("unreachable: a guard")
            if span[1] < LONGEST and length > span[1]:
                raise AssertionError("unreachable: a guard")
    return name, deterministic


@assume_constant_result  # the decorator of torch.compiler, without importing torch._dynamo
def _decide_at_trace_time(facts: tuple, forced, fields: tuple, mask_dims: tuple) -> tuple:
    """Decide once while tracing (eagerly, outside the graph); for a symbolic length (its
    ``fields`` and ``mask_dims``) also prove the span of lengths with the same decision.
    Returns (backend name, deterministic, (lo, hi) or None).  ``facts``: a CallFacts as a
    plain tuple (dynamo rebuilds a NamedTuple constant wrongly)."""
    problem = make_problem(CallFacts._make(facts))
    decision = dispatch.decide(problem, forced)
    span = dispatch.length_span(decision, forced, 1, LONGEST, fields, mask_dims) if fields else None
    what = "=".join(("Sq" if f == "seqlen_q" else "Sk") for f in fields)
    if span is not None:
        lo, hi = span
        note = (
            f"torch.compile: decided while tracing, for {what}={getattr(problem, fields[0])} traced symbolically; "
            f"the same decision for every length {f'from {lo}' if hi >= LONGEST else f'in {lo}..{hi}'} (proven), which the "
            f"graph guards: a length outside it traces again"
        )
    elif fields:
        note = (
            f"torch.compile: decided while tracing; {what} is symbolic but the decision could not be proven "
            f"past {getattr(problem, fields[0])}, so the graph is specialised to these sizes"
        )
    else:
        note = "torch.compile: decided while tracing, for these sizes (another size traces again)"
    note_decision(dataclasses.replace(decision, notes=decision.notes + (note,)))
    return decision.backend, problem.deterministic, span


def _constant(fact):
    """A fact as a Python constant: a size that torch.compile traces symbolically is
    specialised to its value, a guard, so the decision is taken for the real size and another
    size traces again (int() would stay symbolic)."""
    if type(fact) is bool or isinstance(fact, torch.SymBool):  # dynamo's SymBool passes as bool
        return bool(operator.index(fact))
    if type(fact) is int or isinstance(fact, torch.SymInt):  # dynamo's SymInt passes as int
        return operator.index(fact)
    if isinstance(fact, tuple):
        return tuple(_constant(part) for part in fact)
    return fact
