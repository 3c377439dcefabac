"""What torch.compile needs of this package, without importing torch._dynamo on import
(about 3 s, half of ``import attention_dispatch``)."""

from __future__ import annotations


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without its import of torch._dynamo: that
    decorator only marks the function (torch 2.4 .. 2.13), and dynamo reads the mark when it
    traces a call (tests/test_compile.py fails should a release change this)."""
    fn._dynamo_marked_constant = True
    return fn
