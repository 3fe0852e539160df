"""bf16 features on the CPU over Gloo: fp32 operands against reduced operands.

The CPU's default widens bf16 features to fp32 before the gather and the
GEMMs; CUDA's policy (src/engine/precision.h), which CONTRAX_REDUCED_OPERANDS=1
applies on the CPU too, gathers and multiplies them in bf16 (each product's
rounded operands widened per panel or tile, since the CPU has no bf16 GEMM with
an fp32 result). This measures what that costs and saves on the CPU. The
switch is read once per process, so each round launches both policies in
turn, W ranks each. A launch times `calls` steps of clip_loss forward +
backward on [rows, width] bf16 features per rank after one warm-up step; its
time is the slowest rank's mean per step, its bytes the communicator's count
for one step on rank 0. Rank 0 of the first launch prints the median over the
rounds, the spread (fastest and slowest round) and the ratios:

    python3 python/bench/reduced_operands.py [--world 2] [--rows 2048] [--width 256] [--path materialised]
"""
import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slowest_rank import slowest_rank_mean

POLICIES = {"fp32 operands (CPU default)": "0", "bf16 operands (CONTRAX_REDUCED_OPERANDS=1)": "1"}


def run(rank, world, init, out, rows, width, path, calls):
    import contrax  # after the parent set the policy's environment

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(rows, width, generator=g).bfloat16().requires_grad_(True)
    b = torch.randn(rows, width, generator=g).bfloat16().requires_grad_(True)
    s = torch.tensor(2.6, requires_grad=True)
    comm = contrax.communicator()

    def step():
        contrax.clip_loss(a, b, s, normalize=True, path=path).backward()

    step()  # warm-up: the kept workspace, the thread pool
    comm.reset_stats()
    step()
    sent = sum(op["bytes_sent"] for name, op in comm.stats().items() if name != "metadata")
    seconds = slowest_rank_mean(step, calls)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "bytes": sent}, f)
    dist.destroy_process_group()


def launch(policy, a, d, k):
    os.environ["CONTRAX_REDUCED_OPERANDS"] = POLICIES[policy]
    init, out = os.path.join(d, "init%d" % k), os.path.join(d, "out%d.json" % k)
    mp.spawn(run, args=(a.world, init, out, a.rows, a.width, a.path, a.calls), nprocs=a.world)
    with open(out) as f:
        return json.load(f)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--path", default="materialised", choices=["materialised", "tiled"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3)
    a = p.parse_args()
    results = {name: [] for name in POLICIES}
    with tempfile.TemporaryDirectory() as d:
        k = 0
        for _ in range(a.rounds):
            for name in POLICIES:
                results[name].append(launch(name, a, d, k))
                k += 1
    print("torch %s, Gloo, W=%d, %d x %d bf16 features per rank, clip_loss path %s, %d rounds of %d steps, "
          "1 thread per rank" % (torch.__version__, a.world, a.rows, a.width, a.path, a.rounds, a.calls))
    base = statistics.median(r["seconds"] for r in results[next(iter(POLICIES))])
    base_bytes = results[next(iter(POLICIES))][0]["bytes"]
    for name, rs in results.items():
        t = [r["seconds"] for r in rs]
        print("  %-44s median %.1f ms per step (spread %.1f-%.1f), %.2fx the time; %.2f MiB sent per step, %.2fx"
              % (name, 1e3 * statistics.median(t), 1e3 * min(t), 1e3 * max(t), statistics.median(t) / base,
                 rs[0]["bytes"] / 2**20, rs[0]["bytes"] / base_bytes))
