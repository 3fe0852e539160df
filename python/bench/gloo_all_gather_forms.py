"""Gloo's two all-gathers side by side: the list form and the single tensor.

Why Contrax gathers equal row counts with the single-tensor all-gather on
every backend (Communicator::all_gather_rows): NCCL's list form adds a copy
per rank, and this measures that Gloo's single-tensor form is no slower than
its list form. A round times 5 calls of each form in turn; its time is the
slowest rank's mean per call. Rank 0 prints the median over 9 rounds, the
spread (the fastest and the slowest round) and the ratio to the list form:

    python3 python/bench/gloo_all_gather_forms.py [--world 2] [--rows 4096] [--width 768]
"""
import argparse

import torch
import torch.distributed as dist

from _harness import slowest_rank_mean, spawn_ranks, timing_row


def run(rank, world, rows, width, rounds, calls):
    x = torch.randn(rows, width)
    out = torch.empty(world * rows, width)

    def listed():
        dist.all_gather(list(out.chunk(world)), x)

    def single():
        dist.all_gather_into_tensor(out, x)

    forms = {"list": listed, "single tensor": single}
    times = {name: [] for name in forms}
    for fn in forms.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in forms.items():
            times[name].append(slowest_rank_mean(fn, calls))
    if rank == 0:
        print("torch %s, Gloo, W=%d, %d x %d fp32 per rank (%.1f MiB), %d rounds of %d calls"
              % (torch.__version__, world, rows, width, rows * width * 4 / 2**20, rounds, calls))
        for name, t in times.items():
            print(timing_row(name, t, times["list"]) + " the list form")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args()
    spawn_ranks(run, a.world, a.rows, a.width, a.rounds, a.calls)
