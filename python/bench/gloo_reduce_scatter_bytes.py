"""Bytes that Gloo's collectives send through loopback, per call, at W = 2.

Why Contrax keeps its all-to-all reduce-scatter on Gloo for every LibTorch
version: on 2.x, `reduce_scatter_tensor` exists for Gloo but sends as many
bytes as an all-reduce (twice a reduce-scatter's volume), and the list form
`reduce_scatter` is not supported; an all-to-all sends exactly the
reduce-scatter volume. Reads the `lo` transmit counter of /proc/net/dev on
rank 0 around one call (so run it on an otherwise quiet loopback):

    python3 python/bench/gloo_reduce_scatter_bytes.py
"""
import torch
import torch.distributed as dist

from _harness import spawn_ranks

N = 8 * 1024 * 1024  # 32 MiB of float32
OPS = ["reduce_scatter_tensor", "reduce_scatter", "all_reduce", "all_to_all_single"]


def lo_tx():
    for line in open("/proc/net/dev"):
        if line.strip().startswith("lo:"):
            return int(line.split()[9])


def run(rank, world, op):
    x = torch.ones(N)
    out = torch.empty(N // world)
    dist.barrier()
    dist.barrier()
    t0 = lo_tx() if rank == 0 else 0
    dist.barrier()
    if op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(out, x)
    elif op == "reduce_scatter":
        dist.reduce_scatter(out, list(x.chunk(world)))
    elif op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_to_all_single":
        dist.all_to_all_single(torch.empty(N), x)
    dist.barrier()
    if rank == 0:
        print("%-22s W=%d: %.1f MiB through loopback (input %d MiB per rank)"
              % (op, world, (lo_tx() - t0) / 2**20, N * 4 // 2**20), flush=True)


if __name__ == "__main__":
    print("torch", torch.__version__)
    for op in OPS:
        try:
            spawn_ranks(run, 2, op)
        except Exception as e:
            print(op, "failed:", str(e).splitlines()[-1][:200])
