"""Compiled training steps at W = 2 with uneven batches ([5, 2] rows), run by
test_compile.py (torchrun --nproc_per_node 2 compile_steps.py): no graph
break, and the averaged gradients equal eager mode's and one process's on the
concatenated batch (fp64)."""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import contrax  # noqa: E402
from contrax.integrations import open_clip as cx_open_clip  # noqa: E402
from common import F64, finish, init, rel_err, report, share  # noqa: E402

ROWS = [5, 2]


class DualEncoder(torch.nn.Module):
    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.img = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).double()
        self.txt = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)).double()
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07), dtype=F64))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-1.0, dtype=F64))
        self.loss = loss

    def forward(self, x, y):
        return self.loss(self, F.normalize(self.img(x), dim=-1), F.normalize(self.txt(y), dim=-1))


def losses(group):
    oc = cx_open_clip.ClipLoss(world_size=dist.get_world_size(), rank=dist.get_rank()) if group is None else \
        cx_open_clip.ClipLoss()
    return {
        "clip_loss": lambda m, a, b: contrax.clip_loss(a, b, m.logit_scale, m.logit_bias, group=group),
        "siglip_loss": lambda m, a, b: contrax.siglip_loss(a, b, m.logit_scale, m.logit_bias, tile_size=2,
                                                           group=group),
        "nt_xent_loss ring": lambda m, a, b: contrax.nt_xent_loss(a, b, ring=True, tile_size=2, group=group),
        # uneven rows: an unbacked row count (capture_dynamic_output_shape_ops, set below)
        "gather_with_grad": lambda m, a, b: (F.cross_entropy(
            a @ contrax.gather_with_grad(b, group).t() * 5, torch.arange(a.shape[0]) + (
                0 if group is contrax.LOCAL else sum(ROWS[:dist.get_rank()]))) * a.shape[0] * (
                1 if group is contrax.LOCAL else dist.get_world_size()) / sum(ROWS)),
        "open_clip ClipLoss(local_loss=False)": lambda m, a, b: oc(a, b, m.logit_scale.exp(), m.logit_bias),
    }


def grads_after(module, x, y, average):
    for p in module.parameters():
        p.grad = None
    loss = module(x, y)
    loss.backward()
    out = []
    for p in module.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if average:
            g = g.clone()
            dist.all_reduce(g)
            g /= dist.get_world_size()
        out.append(g)
    return loss.detach(), out


def grads_err(got, want):
    """Largest difference over all parameters relative to the largest gradient
    entry (a gradient that is zero in exact arithmetic, such as CLIP's bias,
    holds rounding noise that a per-tensor relative error would magnify)."""
    scale = max(w.abs().max().item() for w in want)
    return max((g - w).abs().max().item() for g, w in zip(got, want)) / scale


def equal_rows_gather(rank, x, everyone):
    """Without capture_dynamic_output_shape_ops the gather promises W * b rows:
    no graph break, and the backward is the sum over ranks of their slices."""
    torch._dynamo.reset()
    weights = torch.arange(16, dtype=F64).reshape(4, 4) + 10 * rank

    def f(x):
        return (contrax.gather_with_grad(x) * weights).sum()

    explained = torch._dynamo.explain(f)(x)
    report(rank, "gather_with_grad equal rows: graph breaks", explained.graph_break_count, 0)
    leaf = x.clone().requires_grad_()
    loss = torch.compile(f, fullgraph=True)(leaf)
    loss.backward()
    report(rank, "gather_with_grad equal rows: value", rel_err(loss.detach(), (everyone * weights).sum()), 1e-14)
    # d/dx_r sum_s <all, w_s> = sum_s w_s[rows of r]
    want_grad = (torch.arange(16, dtype=F64).reshape(4, 4) * 2 + 10)[2 * rank:2 * rank + 2]
    report(rank, "gather_with_grad equal rows: gradient", rel_err(leaf.grad, want_grad), 1e-14)


def main():
    rank, world = init()
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(sum(ROWS), 12, generator=g, dtype=F64), torch.randn(sum(ROWS), 10, generator=g, dtype=F64)
    off, n = share(ROWS, rank)
    x, y = X[off:off + n], Y[off:off + n]
    for name in losses(None):
        torch._dynamo.reset()
        torch._dynamo.config.capture_dynamic_output_shape_ops = name == "gather_with_grad"
        _, want = grads_after(DualEncoder(losses(contrax.LOCAL)[name]), X, Y, average=False)
        eager_loss, eager = grads_after(DualEncoder(losses(None)[name]), x, y, average=True)
        module = DualEncoder(losses(None)[name])
        explained = torch._dynamo.explain(module)(x, y)
        if explained.graph_break_count and rank == 0:
            print(explained.break_reasons, flush=True)
        report(rank, f"{name}: graph breaks", explained.graph_break_count, 0)
        compiled = torch.compile(module, fullgraph=True)
        loss, got = grads_after(compiled, x, y, average=True)
        report(rank, f"{name}: compiled loss vs eager", rel_err(loss, eager_loss), 1e-12)
        report(rank, f"{name}: compiled gradients vs eager", grads_err(got, eager), 1e-10)
        report(rank, f"{name}: compiled gradients vs one process", grads_err(got, want), 1e-10)
    torch._dynamo.config.capture_dynamic_output_shape_ops = False
    equal_rows_gather(rank, X[2 * rank:2 * rank + 2, :4], X[:4, :4])
    try:
        contrax.gather_with_grad(x)  # eager: uneven rows are fine
        torch.ops.contrax.gather_with_grad(x, contrax._ops.group_name(None), True)
        raise AssertionError("uneven rows passed equal_rows=True")
    except RuntimeError as e:
        assert ("contrax::gather_with_grad(): argument 'x': the ranks' row counts 5 2 differ; under torch.compile, "
                "uneven batches need torch._dynamo.config.capture_dynamic_output_shape_ops = True") in str(e), e
    finish(rank)


if __name__ == "__main__":
    main()
