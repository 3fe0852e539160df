"""What the distributed benchmarks share: ranks spawned on a file store, the
time of a step (the slowest rank's mean per call) and the timing row."""
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def slowest_rank_mean(fn, calls):
    """Runs ``fn`` ``calls`` times after a barrier; the slowest rank's mean seconds per call."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    own = torch.tensor([(time.perf_counter() - t0) / calls])
    dist.all_reduce(own, op=dist.ReduceOp.MAX)
    return own.item()


def _rank(rank, fn, world, init, backend, args, results):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method="file://" + init, rank=rank, world_size=world)
    result = fn(rank, world, *args)
    if rank == 0:
        results.put(result)
    dist.destroy_process_group()


def spawn_ranks(fn, world, *args, backend="gloo"):
    """Runs ``fn(rank, world, *args)`` in ``world`` fresh processes of one
    thread each, joined in a process group (NCCL: one GPU per rank); returns
    rank 0's result (small: it passes through a pipe)."""
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(fn, world, os.path.join(d, "init"), backend, args, results), nprocs=world)
    return results.get()


def timing_row(name, t, base, width=14, digits=2, unit="ms"):
    """``name``, the median of the times ``t`` (seconds) in ms (labelled
    ``unit``), their spread (fastest-slowest) and its ratio to ``base``'s median."""
    m = statistics.median(t)
    return "  %-*s median %.*f %s (spread %.*f-%.*f ms), %.2fx" % (
        width, name, digits, 1e3 * m, unit, digits, 1e3 * min(t), digits, 1e3 * max(t), m / statistics.median(base))
