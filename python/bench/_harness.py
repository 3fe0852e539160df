"""The time the distributed benchmarks report for a step: the slowest rank's mean per call."""
import time

import torch
import torch.distributed as dist


def slowest_rank_mean(fn, calls):
    """Runs ``fn`` ``calls`` times after a barrier; the slowest rank's mean seconds per call."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    own = torch.tensor([(time.perf_counter() - t0) / calls])
    dist.all_reduce(own, op=dist.ReduceOp.MAX)
    return own.item()
