"""A full DistributedDataParallel training loop with contrax.clip_loss gives the
same parameters as single-process big-batch training on the concatenated batch."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import contrax
from distributed import F64, clip_ref, offsets, rel_err, run

STEPS = 3
LR = 0.5


class DualEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.img = torch.nn.Linear(6, 4)
        self.txt = torch.nn.Linear(5, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x, y):
        return self.img(x), self.txt(y), self.logit_scale


def _model():
    torch.manual_seed(0)
    return DualEncoder().double()


def _batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    n = sum(rows)
    return torch.randn(n, 6, generator=g, dtype=F64), torch.randn(n, 5, generator=g, dtype=F64)


def _ddp_worker(rank, world, rows):
    # Reference: one process, the whole batch, plain PyTorch loss.
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, rows)
        a, b, s = ref(x, y)
        ref_opt.zero_grad()
        clip_ref(a, b, s, normalize=True).backward()
        ref_opt.step()

    # DDP: each rank its (uneven) share, contrax loss.
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    off, n = offsets(rows, rank)
    for step in range(STEPS):
        x, y = _batch(step, rows)
        a, b, s = model(x[off:off + n], y[off:off + n])
        opt.zero_grad()
        loss = contrax.clip_loss(a, b, s, normalize=True)
        loss.backward()
        opt.step()

    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        assert rel_err(p.detach(), q.detach()) <= 1e-10, (name, rel_err(p.detach(), q.detach()))


@pytest.mark.parametrize("world,rows", [(2, [5, 2]), (4, [3, 1, 4, 2])])
def test_ddp_step_equals_big_batch(world, rows):
    run(world, _ddp_worker, rows)
