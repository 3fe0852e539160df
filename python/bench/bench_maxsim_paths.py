"""Benchmark: contrax.maxsim_loss's memory paths side by side, forward +
backward at W Gloo ranks: materialised (every rank's documents gathered, the
[b x B g] scores held), tiled (documents gathered, the scores walked in steps)
and ring (the documents travel between neighbours with their gradients).

    MALLOC_MMAP_THRESHOLD_=131072 PYTHONPATH=build/python .venv/bin/python \\
        python/bench/bench_maxsim_paths.py --world 2 --rows 2048 --lq 4 --ld 8 --width 32   # the scores dominate
    ... --world 8 --rows 32 --lq 32 --ld 256 --width 128                                   # the documents dominate

fp32 on the CPU, one thread per rank. Each path runs in its own freshly
spawned set of W processes on the same inputs (rank r's slice of one seeded
batch). Reported per path: the slowest rank's mean time of one forward +
backward (after one warm-up call), and the peak memory the loss adds, the
largest over the ranks: the increase of each process's peak RSS
(resource.getrusage ru_maxrss) over the calls, after the inputs exist (large
tensors are mmap-backed by glibc, so RSS follows tensor memory; glibc raises
its mmap threshold as large blocks are freed, up to 32 MiB, after which
freed blocks stay in the heap and RSS over-counts: MALLOC_MMAP_THRESHOLD_
fixes it at 128 KiB); with ratios to the materialised path's. Every path's loss and rank 0's query gradient
(its norm and first 2,048 entries) are checked against the materialised
path's.
"""
import argparse
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import slowest_rank_mean, spawn_ranks  # noqa: E402

PATHS = {"materialised": dict(path="materialised"), "tiled": dict(path="tiled"), "ring": dict(path="tiled", ring=True)}


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker(rank, world, path, opts):
    import torch.distributed as dist

    import contrax

    b, g = opts.rows, opts.group
    gen = torch.Generator().manual_seed(0)
    q_all = torch.nn.functional.normalize(torch.randn(world * b, opts.lq, opts.width, generator=gen), dim=-1)
    d_all = torch.nn.functional.normalize(torch.randn(world * b * g, opts.ld, opts.width, generator=gen), dim=-1)
    q0, d0 = q_all[rank * b:(rank + 1) * b].clone(), d_all[rank * b * g:(rank + 1) * b * g].clone()
    del q_all, d_all
    last = {}

    def step():
        q, d = q0.clone().requires_grad_(True), d0.clone().requires_grad_(True)
        loss = contrax.maxsim_loss(q, d, temperature=0.05, panel_bytes=opts.panel_bytes, **PATHS[path])
        loss.backward()
        last.update(loss=loss.detach(), dq=q.grad)

    base = rss_mib()
    step()  # warm-up
    sec = slowest_rank_mean(step, opts.iters)
    peak = torch.tensor([rss_mib() - base])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    loss = last["loss"].clone()
    dist.all_reduce(loss)
    # The first 2,048 entries of dq and its norm: a result passes through a pipe that rank 0 fills before the
    # others are joined (keep it small).
    dq = last["dq"].flatten()
    return sec, peak.item(), loss.item() / world, dq[:2048].numpy().copy(), dq.norm().item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4, help="ranks W")
    p.add_argument("--rows", type=int, default=64, help="queries per rank")
    p.add_argument("--group", type=int, default=1, help="documents per query g")
    p.add_argument("--lq", type=int, default=32)
    p.add_argument("--ld", type=int, default=256)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--panel-bytes", type=int, default=16 << 20, help="maxsim_loss's panel_bytes")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--modes", default="materialised,tiled,ring", help="which paths, comma-separated")
    a = p.parse_args()
    b, B = a.rows, a.world * a.rows
    print(f"torch {torch.__version__}, fp32 on the CPU, W = {a.world} ranks of one thread, {b} queries and {b * a.group} "
          f"documents a rank, Lq = {a.lq}, Ld = {a.ld}, d = {a.width}; scores [{b} x {B * a.group}] = "
          f"{b * B * a.group * 4 / 2**20:.1f} MiB a rank, documents {B * a.group * a.ld * a.width * 4 / 2**20:.1f} MiB "
          f"in all; mean of {a.iters}\n")
    print("| path | fwd+bwd ms | time vs materialised | peak MiB added (largest rank) | peak vs materialised | loss | "
          "max rel diff of dq |")
    print("|---|---|---|---|---|---|---|")
    got = {m: spawn_ranks(worker, a.world, m, a) for m in a.modes.split(",")}
    ref = got.get("materialised")
    for m, (sec, mib, loss, dq, norm) in got.items():
        vs_t = f"{sec / ref[0]:.2f}" if ref else "-"
        vs_m = f"{mib / ref[1]:.3f}" if ref else "-"
        diff = "-"
        if ref:
            want = torch.from_numpy(ref[3])
            entries = ((torch.from_numpy(dq) - want).abs().max() / want.abs().max()).item()
            diff = f"{max(entries, abs(norm / ref[4] - 1)):.1e}"
        print(f"| {m} | {sec * 1e3:.1f} | {vs_t} | {mib:.1f} | {vs_m} | {loss:.6f} | {diff} |")


if __name__ == "__main__":
    main()
