"""The losses on one GPU against the peers a user would pick.

One process, one GPU, forward + backward of each loss on L2-normalised bf16
features ``[B, d]`` with a learnable scale (and bias for SigLIP), side by side
in one run:

* CLIP: Contrax's ``clip_loss`` (path auto), plain PyTorch as open_clip writes
  it (logits under bf16 autocast, ``cross_entropy`` both ways), and memeff's
  ``MemoryEfficientCLIPLoss`` where ``memeff`` is installed (fixed
  temperature: it has no learnable scale);
* SigLIP: Contrax's ``siglip_loss``, plain PyTorch (autocast, ``logsigmoid``
  of the signed logits summed over B), and siglip-kernel's
  ``fused_siglip_loss`` where ``siglip_kernel`` is installed.

Each cell is the median of ``--iters`` timed calls after warm-up (CUDA events
around each call), with the spread (min-max), and the peak memory allocated
above the inputs. A peer that runs out of memory says so in its cell. Before
timing, every implementation's loss is compared with plain PyTorch's in fp32
at the smallest B (a wrong peer would make its time meaningless).

    python python/bench/gpu_losses.py                       # B = 4096, 16384, 65536; d = 768
    python python/bench/gpu_losses.py --batches 4096 --iters 5 --json

Needs a GPU; says so and exits 3 without one.
"""
import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F

import contrax


def plain_clip(a, b, logit_scale, bias):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = logit_scale.exp().clamp(max=100.0) * a @ b.t()
    target = torch.arange(a.shape[0], device=a.device)
    logits = logits.float()
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def plain_siglip(a, b, logit_scale, bias):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = logit_scale.exp() * a @ b.t() + bias
    signs = 2 * torch.eye(a.shape[0], device=a.device) - 1
    return -F.logsigmoid(signs * logits.float()).sum() / a.shape[0]


def peers():
    """{loss: [(name, fn)]}: Contrax and plain PyTorch always, the peer packages where installed."""
    table = {"clip": [("plain PyTorch (autocast)", plain_clip),
                      ("Contrax clip_loss", lambda a, b, s, t: contrax.clip_loss(a, b, s))],
             "siglip": [("plain PyTorch (autocast)", plain_siglip), ("Contrax siglip_loss", contrax.siglip_loss)]}
    try:
        import memeff
        loss = memeff.MemoryEfficientCLIPLoss(temperature=0.07, normalized_inputs=True, stable=False)
        table["clip"].append((f"memeff {memeff.__version__}", lambda a, b, s, t: loss(a, b)))
    except ImportError:
        pass
    try:
        import siglip_kernel
        version = getattr(siglip_kernel, "__version__", "")
        table["siglip"].append((f"siglip-kernel {version}".strip(),
                                lambda a, b, s, t: siglip_kernel.fused_siglip_loss(a, b, s, t)))
    except ImportError:
        pass
    return table


def inputs(rows, width, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = F.normalize(torch.randn(rows, width, device="cuda", generator=g), dim=1).to(dtype).requires_grad_()
    b = F.normalize(torch.randn(rows, width, device="cuda", generator=g), dim=1).to(dtype).requires_grad_()
    scale = torch.tensor(math.log(1 / 0.07), device="cuda", requires_grad=True)
    bias = torch.tensor(-10.0, device="cuda", requires_grad=True)
    return a, b, scale, bias


def step(fn, x):
    for t in x:
        t.grad = None
    loss = fn(*x)
    loss.backward()
    return loss


def measure(fn, x, iters, warmup=3):
    """(median ms, min ms, max ms, peak MiB above the inputs), or the error's first line."""
    try:
        for _ in range(warmup):
            step(fn, x)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(fn, x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        return statistics.median(times), min(times), max(times), peak
    except torch.OutOfMemoryError:
        return "out of memory"
    finally:
        for t in x:
            t.grad = None
        torch.cuda.empty_cache()


def check_agreement(table, width):
    """Every implementation's loss against plain PyTorch's, fp32 features, B = 512."""
    x = inputs(512, width, torch.float32, seed=1)
    worst = {}
    for loss, impls in table.items():
        want = impls[0][1](*x).item()
        for name, fn in impls[1:]:
            try:
                got = fn(*x).item()
                worst[f"{loss}: {name}"] = f"{abs(got - want) / max(abs(want), 1e-6):.1e}"
            except Exception as e:  # a peer may take bf16/fp16 only: say so, time it anyway
                worst[f"{loss}: {name}"] = f"not comparable in fp32 ({str(e).splitlines()[0][:80]})"
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="4096,16384,65536", help="comma-separated global batch sizes B")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_losses.py: no GPU (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
        sys.exit(3)
    batches = [int(v) for v in args.batches.split(",")]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    table = peers()
    agreement = check_agreement(table, args.width)
    results = []
    for loss, impls in table.items():
        for name, fn in impls:
            for rows in batches:
                x = inputs(rows, args.width, dtype)
                r = measure(fn, x, args.iters)
                del x
                results.append({"loss": loss, "impl": name, "B": rows, "result": r})
    device = torch.cuda.get_device_name(0)
    head = (f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda}, {args.dtype}, d = {args.width}, "
            f"forward + backward, median of {args.iters} (min-max), peak allocated above the inputs")
    if args.json:
        print(json.dumps({"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                          "dtype": args.dtype, "width": args.width, "iters": args.iters,
                          "agreement": agreement, "results": results}))
        return
    print(head)
    print("loss agreement with plain PyTorch (fp32, B = 512, relative): " +
          ", ".join(f"{k} {v}" for k, v in agreement.items()))
    print(f"{'loss':<7} {'implementation':<26} " + " ".join(f"{'B = ' + str(b):>26}" for b in batches))
    for loss, impls in table.items():
        for name, _ in impls:
            cells = []
            for rows in batches:
                r = next(x["result"] for x in results if x["loss"] == loss and x["impl"] == name and x["B"] == rows)
                cells.append(f"{r:>26}" if isinstance(r, str) else
                             f"{r[0]:8.2f} ms ({r[1]:.2f}-{r[2]:.2f}) {r[3]:6.0f} MiB".rjust(26))
            print(f"{loss:<7} {name:<26} " + " ".join(cells))


if __name__ == "__main__":
    main()
