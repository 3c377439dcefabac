"""context_parallel_sdpa's merged backward decides each block's backend apart from the block's
forward (distributed.merged.backward_backends): the merged out and lse do not depend on which
backend computed a block, so its backward goes to the backend decide() takes for the block as a
training call from a given output; with dropout it stays on the forward's (its keep-mask)."""

from __future__ import annotations

import dataclasses
import types

import torch

import attention_dispatch as ad
from attention_dispatch import registry
from attention_dispatch.backends.math import MathBackend
from attention_dispatch.call import normalize_call
from attention_dispatch.dispatch import decide, use_backends
from attention_dispatch.distributed.merged import backward_backends


class _BackwardOnly(MathBackend):
    """Serves only backward-from-output calls (a stand-in for a backend whose backward is the faster)."""

    name = "backward_only_test"
    reference = False
    capabilities = dataclasses.replace(MathBackend.capabilities, notes="test backend")

    def check(self, problem):
        return [] if problem.backward_from_output else ["forward calls: not this test backend"]


def _served():
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    problem = normalize_call(q, k, v, enable_gqa=True, return_lse=True).problem
    with use_backends(_BackwardOnly.name, "math"):
        forward = decide(problem)
    assert forward.backend == "math" and not forward.problem.requires_grad
    return {(0, (0,), (0,)): forward, (1, (0,), (0,)): forward}


def test_block_backward_is_decided_apart_from_its_forward():
    registry.register_backend(_BackwardOnly(), priority=0)
    try:
        served = _served()
        setup = types.SimpleNamespace(dropout_p=0.0, backward_backends=(_BackwardOnly.name, "math"))
        with ad.record() as decisions:
            chosen = backward_backends(setup, served)
        assert set(chosen.values()) == {_BackwardOnly.name}
        (noted,) = decisions  # one decision for the two blocks of one Problem, noted as it differs
        assert noted.backend == _BackwardOnly.name
        assert noted.problem.requires_grad and noted.problem.backward_from_output and not noted.problem.return_lse
        assert "grad from a given out/lse" in noted.problem.summary()
        # a backend not declaring Capabilities.backward_from_output is refused with a reason
        assert "backward from a given output and logsumexp (run_backward) not supported" in " ".join(
            r
            for name in ad.list_backends()
            if not registry.get_backend(name).capabilities.backward_from_output
            for r in registry.get_backend(name).reasons(noted.problem)
        )

        dropout = types.SimpleNamespace(dropout_p=0.1, backward_backends=setup.backward_backends)
        with ad.record() as decisions:
            assert set(backward_backends(dropout, served).values()) == {"math"}  # the forward's keep-mask
        assert not decisions
    finally:
        registry.unregister_backend(_BackwardOnly.name)
