"""Benchmark: contrax.maxsim_loss forward+backward against the late-interaction
loss as PyLate (losses.Contrastive) and colpali-engine (ColbertLoss) compute
it: every token score of every query-document pair at once (einsum
"ash,bth->abst", [n, m, Lq, Ld]), the maximum over document tokens, the sum
over query tokens, then cross-entropy with the diagonal as positives.

    PYTHONPATH=build/python .venv/bin/python python/bench/bench_maxsim.py --rows 128,256 --lq 32 --ld 256 --width 128
    ... bench_maxsim.py --rows 1024 --only contrax      # the einsum's [1024 x 1024 x 32 x 256] fp32 is 32 GiB

One process, fp32 on the CPU. Each (implementation, rows) pair runs in its own
freshly spawned process on the same inputs (same seed). Reported: the median
wall time of one forward+backward (2 warm-up iterations excluded) and the peak
memory the loss adds: the largest increase of the process's peak RSS
(resource.getrusage ru_maxrss) over the loss iterations, after the inputs
exist (large tensors are mmap-backed by glibc, so RSS follows tensor memory).
Both losses are checked equal (loss and query gradient).
"""
import argparse
import multiprocessing as mp
import resource
import statistics
import time

import torch
import torch.nn.functional as F


def einsum_loss(q, d, temperature):
    scores = torch.einsum("ash,bth->abst", q, d).max(dim=3).values.sum(dim=2)  # [n, m]
    return F.cross_entropy(scores / temperature, torch.arange(q.shape[0]))


def _run(impl, rows, lq, ld, width, iters, out):
    import contrax
    torch.set_num_threads(torch.get_num_threads())
    g = torch.Generator().manual_seed(0)
    q0 = F.normalize(torch.randn(rows, lq, width, generator=g), dim=-1)
    d0 = F.normalize(torch.randn(rows, ld, width, generator=g), dim=-1)
    fn = einsum_loss if impl == "einsum" else (lambda q, d, t: contrax.maxsim_loss(q, d, temperature=t))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for it in range(iters + 2):
        q, d = q0.clone().requires_grad_(True), d0.clone().requires_grad_(True)
        start = time.perf_counter()
        loss = fn(q, d, 0.05)
        loss.backward()
        if it >= 2:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB
    # the gradient as bytes (a tensor would travel as a file descriptor of a process that exits)
    out.put((impl, rows, statistics.median(times), peak / 1024.0, loss.item(), q.grad.numpy().copy()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="128,256", help="queries = documents per call, comma-separated")
    p.add_argument("--lq", type=int, default=32)
    p.add_argument("--ld", type=int, default=256)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--only", default="einsum,contrax", help="which implementations")
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    print(f"torch {torch.__version__}, fp32 on the CPU, {torch.get_num_threads()} threads, Lq = {a.lq}, "
          f"Ld = {a.ld}, d = {a.width}, median of {a.iters}\n")
    print("| n = m | implementation | fwd+bwd ms | time vs einsum | peak MiB added | peak vs einsum | "
          "loss | max rel diff of dq vs einsum |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in a.rows.split(",")):
        got = {}
        for impl in a.only.split(","):
            out = ctx.Queue()
            proc = ctx.Process(target=_run, args=(impl, rows, a.lq, a.ld, a.width, a.iters, out))
            proc.start()
            got[impl] = out.get()
            proc.join()
        ref = got.get("einsum")
        for impl, (_, _, sec, mib, loss, dq) in got.items():
            dq = torch.from_numpy(dq)
            vs_t = f"{sec / ref[2]:.2f}" if ref else "-"
            vs_m = f"{mib / ref[3]:.3f}" if ref else "-"
            want = torch.from_numpy(ref[5]) if ref else None
            diff = f"{((dq - want).abs().max() / want.abs().max()).item():.1e}" if ref else "-"
            print(f"| {rows} | {impl} | {sec * 1e3:.1f} | {vs_t} | {mib:.1f} | {vs_m} | {loss:.6f} | {diff} |")


if __name__ == "__main__":
    main()
