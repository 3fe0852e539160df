"""SimCLR steps with lightly's NTXentLoss(gather_distributed=True) and with
contrax.integrations.lightly's, against one process on the concatenated
global batch. Run by test_lightly.py (main() on the suite's shared rank
processes), or by hand:

    torchrun --nproc_per_node W lightly_steps.py

The model is a small backbone and lightly's SimCLRProjectionHead (without
batch norm, whose per-rank statistics no loss can make equal to one
process's); the loop is lightly's examples/pytorch/simclr.py's.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from lightly.loss import NTXentLoss as LightlyNTXent  # noqa: E402
from lightly.models.modules import SimCLRProjectionHead  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import contrax.integrations.lightly as cx  # noqa: E402
from common import F64, finish, init, mean_over_ranks, params_err, rel_err, report, sgd_steps, share  # noqa: E402

STEPS = 3
EXACT = 1e-10
FP32 = 2e-5
TEMPERATURE = 0.5


class SimCLR(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU())
        self.projection_head = SimCLRProjectionHead(24, 24, 8, batch_norm=False)

    def forward(self, x):
        return self.projection_head(self.backbone(x))


def batches(rows, rank, dtype, whole=False):
    """STEPS global batches of two views of sum(rows) examples; this rank's share unless `whole`."""
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(200 + step)
        x = torch.randn(sum(rows), 12, generator=g, dtype=dtype)
        x0 = x + 0.3 * torch.randn(x.shape, generator=g, dtype=dtype)
        x1 = x + 0.3 * torch.randn(x.shape, generator=g, dtype=dtype)
        if not whole:
            off, count = share(rows, rank)
            x0, x1 = x0[off:off + count], x1[off:off + count]
        out.append((x0, x1))
    return out


def train(criterion, items, *, dtype=F64, ddp=True):
    """STEPS steps of lightly's SimCLR example loop; returns (model, per-step losses)."""
    torch.manual_seed(0)
    model = SimCLR().to(dtype)
    wrapped = DDP(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.06, momentum=0.9)
    return model, sgd_steps(opt, items, lambda views: criterion(wrapped(views[0]), wrapped(views[1])))


def main():
    rank, world = init()
    even = [4] * world
    uneven = {1: [6], 2: [5, 2], 4: [3, 1, 4, 2]}[world]
    items = batches(even, rank, F64)

    ref = train(LightlyNTXent(TEMPERATURE), batches(even, rank, F64, whole=True), ddp=False)
    lightly = train(LightlyNTXent(TEMPERATURE, gather_distributed=True), items)
    got = train(cx.NTXentLoss(TEMPERATURE, gather_distributed=True), items)
    report(rank, "lightly vs contrax NTXentLoss(gather_distributed=True): loss values on every rank",
           rel_err(got[1], lightly[1]), EXACT)
    report(rank, "lightly vs contrax NTXentLoss(gather_distributed=True): parameters",
           params_err(got[0], lightly[0]), EXACT)
    report(rank, "contrax NTXentLoss(gather_distributed=True): parameters vs one process",
           params_err(got[0], ref[0]), EXACT)
    report(rank, "contrax NTXentLoss(gather_distributed=True): mean loss vs one process",
           rel_err(mean_over_ranks(got[1]), ref[1]), EXACT)
    report(rank, "lightly NTXentLoss(gather_distributed=True): parameters vs one process",
           params_err(lightly[0], ref[0]), EXACT)

    # gather_distributed=False is lightly's local loss, here as there.
    local = train(cx.NTXentLoss(TEMPERATURE), items)
    lightly_local = train(LightlyNTXent(TEMPERATURE), items)
    report(rank, "lightly vs contrax NTXentLoss(gather_distributed=False): parameters",
           params_err(local[0], lightly_local[0]), EXACT)
    if world > 1:
        report(rank, "NTXentLoss(gather_distributed=False): parameters vs one process (inexact)",
               params_err(local[0], ref[0]), 1e-4, above=True)
        ref_u = train(LightlyNTXent(TEMPERATURE), batches(uneven, rank, F64, whole=True), ddp=False)
        items_u = batches(uneven, rank, F64)
        for name, loss in (("", cx.NTXentLoss(TEMPERATURE, gather_distributed=True)),
                           ("path='tiled', tile_size=3, ", cx.NTXentLoss(TEMPERATURE, gather_distributed=True,
                                                                         path="tiled", tile_size=3)),
                           ("ring=True, tile_size=2, ", cx.NTXentLoss(TEMPERATURE, gather_distributed=True,
                                                                      ring=True, tile_size=2))):
            got_u = train(loss, items_u)
            report(rank, f"contrax NTXentLoss({name}gather_distributed=True) uneven {uneven}: parameters vs "
                   "one process", params_err(got_u[0], ref_u[0]), EXACT)
            report(rank, f"contrax NTXentLoss({name}gather_distributed=True) uneven {uneven}: mean loss vs one "
                   "process", rel_err(mean_over_ranks(got_u[1]), ref_u[1]), EXACT)

    items32 = batches(even, rank, torch.float32)
    got = train(cx.NTXentLoss(TEMPERATURE, gather_distributed=True), items32, dtype=torch.float32)
    lightly = train(LightlyNTXent(TEMPERATURE, gather_distributed=True), items32, dtype=torch.float32)
    report(rank, "fp32 lightly vs contrax NTXentLoss: loss values", rel_err(got[1], lightly[1]), FP32)
    report(rank, "fp32 lightly vs contrax NTXentLoss: parameters", params_err(got[0], lightly[0]), FP32)
    finish(rank)


if __name__ == "__main__":
    main()
