"""Contrax's losses and GradCache with FSDP2 (torch.distributed.fsdp.fully_shard)
encoders, run by test_fsdp2.py under torchrun at W = 2 on Gloo (CPU): every
parameter's gradient (the sharded gradients gathered with full_tensor())
equals the DDP run's on the same rows, in fp64, and the DDP run equals one
process on the concatenated batch. Equal per-rank batches: FSDP2
all-gathers the parameters in every forward, so every rank runs the same
number of forwards (GradCache: the same number of chunks)."""
import copy
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import contrax  # noqa: E402
from common import F64, finish, init, report, share  # noqa: E402

ROWS = [6, 6]


def tower(d_in, seed):
    torch.manual_seed(seed)
    # dropout: GradCache's second pass must replay the first pass's masks
    return torch.nn.Sequential(torch.nn.Linear(d_in, 16), torch.nn.GELU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(16, 7)).double()


class Scale(torch.nn.Module):
    """The CLIP temperature as a (replicated or sharded) module of its own
    (1-element vectors: fully_shard refuses 0-dim parameters)."""

    def __init__(self):
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor([math.log(1 / 0.07)], dtype=F64))
        self.logit_bias = torch.nn.Parameter(torch.tensor([-2.0], dtype=F64))

    def forward(self):
        return self.logit_scale.reshape(()), self.logit_bias.reshape(())


def models():
    return torch.nn.ModuleDict({"img": tower(12, 1), "txt": tower(10, 2), "scale": Scale()})


def steps(group):
    """Each step as fn(model, x, y) -> loss; model holds img, txt, scale (maybe wrapped)."""
    def clip(m, x, y):
        s, _ = m["scale"]()
        return contrax.clip_loss(m["img"](x), m["txt"](y), s, normalize=True, group=group)

    def siglip(m, x, y):
        s, b = m["scale"]()
        return contrax.siglip_loss(m["img"](x), m["txt"](y), s, b, normalize=True, tile_size=4, group=group)

    def nt_xent_tiled(m, x, y):
        return contrax.nt_xent_loss(m["img"](x), m["txt"](y), temperature=0.2, path="tiled", tile_size=4,
                                    ring=True, group=group)

    def grad_cache(m, x, y):
        s, _ = m["scale"]()
        gc = contrax.GradCache([contrax.GradCacheEncoder(m["img"], 4), contrax.GradCacheEncoder(m["txt"], 3)],
                               lambda a, b: contrax.clip_loss(a, b, s, normalize=True, group=group))
        return gc.step(x, y)

    return {"clip_loss": clip, "siglip_loss": siglip, "nt_xent_loss tiled ring": nt_xent_tiled,
            "GradCache clip_loss": grad_cache}


def full_grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            g = torch.zeros_like(p.full_tensor() if hasattr(p, "full_tensor") else p)
        out[name.replace("module.", "")] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def max_err(got, want):
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    scale = max(w.abs().max().item() for w in want.values())
    if os.environ.get("CX_DEBUG"):
        print({n: (got[n] - want[n]).abs().max().item() / scale for n in want}, flush=True)
    return max((got[n] - want[n]).abs().max().item() for n in want) / scale


def main():
    rank, world = init()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(4)
    X, Y = torch.randn(sum(ROWS), 12, generator=g, dtype=F64), torch.randn(sum(ROWS), 10, generator=g, dtype=F64)
    off, n = share(ROWS, rank)
    x, y = X[off:off + n], Y[off:off + n]
    for name, step in steps(None).items():
        base = models()
        # DDP: every module replicated, gradients averaged
        ddp = torch.nn.ModuleDict({k: DDP(copy.deepcopy(v), find_unused_parameters=True) for k, v in base.items()})
        torch.manual_seed(100 + rank)
        loss_ddp = step(ddp, x, y)
        if loss_ddp.requires_grad:  # GradCache's step has done its backward
            loss_ddp.backward()
        want = full_grads(ddp)
        # FSDP2: each Linear and each tower sharded over the mesh, the scale too
        fsdp = copy.deepcopy(base)
        for key in ("img", "txt"):
            for layer in fsdp[key]:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(fsdp[key], mesh=mesh)
        fully_shard(fsdp["scale"], mesh=mesh)
        assert type(fsdp["img"][0].weight).__name__ == "DTensor"
        torch.manual_seed(100 + rank)
        loss = step(fsdp, x, y)
        if loss.requires_grad:
            loss.backward()
        got = full_grads(fsdp)
        losses = torch.stack([loss.detach(), loss_ddp.detach()])
        report(rank, f"{name}: FSDP2 loss vs DDP", (losses[0] - losses[1]).abs().item(), 1e-13)
        report(rank, f"{name}: FSDP2 gradients vs DDP", max_err(got, want), 1e-12)
    # DDP itself against one process (eval mode: no dropout, whose masks differ)
    for name, step in steps(None).items():
        base = models().eval()
        ddp = torch.nn.ModuleDict({k: DDP(copy.deepcopy(v), find_unused_parameters=True) for k, v in base.items()})
        loss = step(ddp, x, y)
        if loss.requires_grad:
            loss.backward()
        got = full_grads(ddp)
        one = models().eval()
        ref = steps(contrax.LOCAL)[name](one, X, Y)
        if ref.requires_grad:
            ref.backward()
        report(rank, f"{name}: DDP (eval) gradients vs one process", max_err(got, full_grads(one)), 1e-12)
    finish(rank)


if __name__ == "__main__":
    main()
