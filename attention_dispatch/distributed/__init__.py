"""Context parallelism: ad.sdpa() over a sequence sharded across the ranks of a torch.distributed
group (docs/distributed.md). Not imported by ``import attention_dispatch``.

    from attention_dispatch.distributed import context_parallel_sdpa, shard, unshard
"""

from .api import BackwardChoice, context_parallel_sdpa, cross_rank_checks, last_backward
from .layout import LAYOUTS, shard, unshard

__all__ = [
    "context_parallel_sdpa",
    "cross_rank_checks",
    "last_backward",
    "BackwardChoice",
    "shard",
    "unshard",
    "LAYOUTS",
]
