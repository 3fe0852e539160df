"""Benchmark: contrax.clip_loss forward+backward vs a straightforward Python
[local x global] CLIP loss built on torch.distributed.nn.all_gather.

    PYTHONPATH=build/python .venv/bin/python python/bench/bench_clip.py --world 2,4 --batch 2048 --width 256
    # on GPUs (tools/gpu_check.sh): NCCL, one GPU per rank, bf16 autocast as open_clip trains
    ... bench_clip.py --device cuda --world 2 --batch 4096 --width 768 --autocast

Each (implementation, W) pair runs in its own freshly spawned set of W
processes (Gloo, one thread each; NCCL with --device cuda) on the same inputs
(same seed). Reported per pair: median wall time of one forward+backward (rank
0, after a barrier, 2 warm-up iterations excluded) and peak memory: on the CPU
the largest increase of the process's peak RSS (resource.getrusage ru_maxrss)
over the loss iterations, taken over ranks (large tensors are mmap-backed by
glibc, so RSS follows tensor memory; the baseline is taken after the inputs
exist); on CUDA torch.cuda.max_memory_allocated above the inputs. Both losses
are checked equal. --autocast runs both under torch.autocast(bf16): the
Python loss's GEMMs and cross-entropy then run as autocast decides, Contrax's
engine excludes autocast and keeps its own precision policy.
"""
import contextlib
import argparse
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F

from _harness import spawn_ranks


def naive_clip_loss(a, b, logit_scale):
    """The common Python pattern: all_gather with autograd, [local x global] logits."""
    rank = dist.get_rank()
    a_all = torch.cat(dist_nn.all_gather(a), dim=0)
    b_all = torch.cat(dist_nn.all_gather(b), dim=0)
    scale = logit_scale.exp().clamp(max=100.0)
    target = torch.arange(rank * a.shape[0], (rank + 1) * a.shape[0], device=a.device)
    la = a @ b_all.t() * scale
    lb = b @ a_all.t() * scale
    return (F.cross_entropy(la, target) + F.cross_entropy(lb, target)) / 2


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker(rank, world, impl, opts):
    cuda = opts.device == "cuda"
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    import contrax

    batch, width = opts.batch, opts.width
    g = torch.Generator().manual_seed(0)
    a_all = torch.randn(world * batch, width, generator=g)
    b_all = torch.randn(world * batch, width, generator=g)
    a = a_all[rank * batch:(rank + 1) * batch].to(dev).requires_grad_(True)
    b = b_all[rank * batch:(rank + 1) * batch].to(dev).requires_grad_(True)
    del a_all, b_all
    s = torch.tensor(2.5, device=dev, requires_grad=True)

    def loss_of(x, y):
        if impl == "python":
            return naive_clip_loss(x, y, s)
        ring = opts.path == "ring"
        return contrax.clip_loss(x, y, s, path="tiled" if ring else opts.path, ring=ring)

    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if opts.autocast
                else contextlib.nullcontext())

    def step(x, y):
        with autocast:
            loss = loss_of(x, y)
        loss.backward()
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    # Warm-up on a tiny batch loads code paths without raising the peak much.
    step(*[t[:4].detach().clone().requires_grad_(True) for t in (a, b)])
    sync()
    dist.barrier()

    base = rss_mib()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        base_cuda = torch.cuda.memory_allocated(dev) / 2**20
    times, loss_value = [], None
    for it in range(opts.iters + 2):
        a.grad = b.grad = s.grad = None
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        loss = step(a, b)
        sync()
        dt = time.perf_counter() - t0
        if it >= 2:
            times.append(dt)
        loss_value = loss.item()
        del loss
    used = torch.cuda.max_memory_allocated(dev) / 2**20 - base_cuda if cuda else rss_mib() - base
    peak = torch.tensor([used], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    total = torch.tensor([loss_value], dtype=torch.float64, device=dev)
    dist.all_reduce(total)
    return impl, world, statistics.median(times), peak.item(), total.item() / world


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default="2,4", help="comma-separated world sizes")
    p.add_argument("--batch", type=int, default=2048, help="rows per rank")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    p.add_argument("--path", choices=["auto", "materialised", "tiled", "ring"], default="auto",
                   help="Contrax's memory path")
    p.add_argument("--autocast", action="store_true", help="both losses under torch.autocast(bf16)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    where = (f"{torch.cuda.get_device_name(0)}, NCCL" if args.device == "cuda" else "CPU, Gloo, 1 thread/rank")
    peak = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "ru_maxrss"
    print(f"CLIP forward+backward, fp32{' under bf16 autocast' if args.autocast else ''}, {args.batch} rows/rank, "
          f"width {args.width}, Contrax path {args.path}, {where}, torch {torch.__version__}, median of "
          f"{args.iters}; peak = max over ranks of the {peak} increase")
    print(f"{'W':>2}  {'contrax ms':>10}  {'python ms':>10}  {'time ratio':>10}  "
          f"{'contrax MiB':>11}  {'python MiB':>10}  {'mem ratio':>9}  {'loss diff':>9}")
    for world in [int(w) for w in args.world.split(",")]:
        res = {impl: spawn_ranks(worker, world, impl, args, backend="nccl" if args.device == "cuda" else "gloo")
               for impl in ("contrax", "python")}
        (_, _, tc, mc, lc), (_, _, tp, mp_, lp) = res["contrax"], res["python"]
        print(f"{world:>2}  {tc * 1e3:>10.1f}  {tp * 1e3:>10.1f}  {tc / tp:>10.2f}  "
              f"{mc:>11.1f}  {mp_:>10.1f}  {mc / max(mp_, 1e-9):>9.2f}  {abs(lc - lp):>9.1e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
