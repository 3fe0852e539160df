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
for one step on rank 0. The parent prints the median over the rounds, the
spread (fastest and slowest round) and the ratios:

    python3 python/bench/reduced_operands.py [--world 2] [--rows 2048] [--width 256] [--path materialised]
"""
import argparse
import os

import torch

from _harness import slowest_rank_mean, spawn_ranks, timing_row

POLICIES = {"fp32 operands (CPU default)": "0", "bf16 operands (CONTRAX_REDUCED_OPERANDS=1)": "1"}


def run(rank, world, rows, width, path, calls):
    import contrax  # after the parent set the policy's environment

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
    return {"seconds": slowest_rank_mean(step, calls), "bytes": sent}


def launch(policy, a):
    os.environ["CONTRAX_REDUCED_OPERANDS"] = POLICIES[policy]
    return spawn_ranks(run, a.world, a.rows, a.width, a.path, a.calls)


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
    for _ in range(a.rounds):
        for name in POLICIES:
            results[name].append(launch(name, a))
    print("torch %s, Gloo, W=%d, %d x %d bf16 features per rank, clip_loss path %s, %d rounds of %d steps, "
          "1 thread per rank" % (torch.__version__, a.world, a.rows, a.width, a.path, a.rounds, a.calls))
    base = results[next(iter(POLICIES))]
    for name, rs in results.items():
        sent = rs[0]["bytes"]
        print(timing_row(name, [r["seconds"] for r in rs], [r["seconds"] for r in base], 44, 1, "ms per step")
              + " the time; %.2f MiB sent per step, %.2fx" % (sent / 2**20, sent / base[0]["bytes"]))
