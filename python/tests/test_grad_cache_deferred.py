"""GradCache.finish_deferred(): the loss returned to a loop that calls
backward() itself (Hugging Face's Trainer) runs pass 2 in that backward, with
the gradient reaching the loss as its scale; the same gradients as finish()
in fp64, the generators where the backward found them, one DDP all-reduce per
step with uneven batches (W = 2)."""
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import contrax
from contrax import GradCache, GradCacheEncoder
from distributed import F64, offsets, rel_err, run


class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(6, 8)
        self.drop = torch.nn.Dropout(0.3)
        self.l2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(self.drop(torch.tanh(self.l1(x))))


def _data(n=9, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=F64), torch.randn(n, 6, generator=g, dtype=F64)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _step(deferred, scale=1.0):
    model = Tower().double()
    x, y = _data()
    gc = GradCache([GradCacheEncoder(model, 4), GradCacheEncoder(model, 2)],  # tied towers, other chunks
                   lambda a, b: contrax.clip_loss(a, b, torch.tensor(1.0, dtype=F64), normalize=True))
    torch.manual_seed(11)
    if deferred:
        gc.cache(0, x)
        gc.cache(1, y)
        loss = gc.finish_deferred()
        assert loss.requires_grad and loss.is_leaf
        before = torch.get_rng_state()
        (loss * scale).backward()
        assert torch.equal(torch.get_rng_state(), before)  # the backward left the generator as it found it
        with pytest.raises(RuntimeError, match=r"GradCache.finish_deferred\(\): a backward already ran through "
                                               r"this loss"):
            loss.backward()
    else:
        loss = gc.step(x, y)
    return loss.detach(), _grads(model)


def test_deferred_equals_finish_and_scales_with_the_backward():
    loss, grads = _step(False)
    got_loss, got = _step(True)
    assert rel_err(got_loss, loss) <= 1e-14
    for g, w in zip(got, grads):
        assert rel_err(g, w) <= 1e-12
    _, scaled = _step(True, scale=0.25)  # gradient accumulation over 4 micro-steps, say
    for g, w in zip(scaled, grads):
        assert rel_err(g, 0.25 * w) <= 1e-12


def test_deferred_argument_errors():
    gc = GradCache([GradCacheEncoder(Tower().double(), 2)])
    with pytest.raises(ValueError, match=r"GradCache.finish_deferred\(\): encoder 0 has cached nothing; call "
                                         r"cache\(\) for every encoder before finish_deferred\(\)"):
        gc.finish_deferred(lambda a: a.sum())
    gc.cache(0, torch.zeros(2, 6, dtype=F64))
    with pytest.raises(ValueError, match=r"GradCache.finish_deferred\(\): argument 'loss_fn' is required"):
        gc.finish_deferred()
    assert gc.cached_rows(0) == 0  # a failed call consumed the cache


def _counting_hook(state, bucket):
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _ddp_worker(rank, world, rows):
    # No dropout: one process and two ranks draw different masks.
    x_all, y_all = _data(sum(rows), seed=5)
    ref = Tower().double()
    ref.drop.p = 0.0
    s = torch.tensor(0.7, dtype=F64)
    contrax.clip_loss(ref(x_all), ref(y_all), s, normalize=True, group=contrax.LOCAL).backward()

    model = Tower().double()
    model.drop.p = 0.0
    ddp = DDP(model)
    state = {"calls": 0}
    ddp.register_comm_hook(state, _counting_hook)
    off, n = offsets(rows, rank)
    gc = GradCache([GradCacheEncoder(ddp, 2), GradCacheEncoder(ddp, 3)],
                   lambda a, b: contrax.clip_loss(a, b, s, normalize=True))
    gc.cache(0, x_all[off:off + n])
    gc.cache(1, y_all[off:off + n])
    loss = gc.finish_deferred()
    (loss / 2).backward()  # gradient accumulation of 2: half the gradient
    assert state["calls"] == 1, state
    for g, w in zip(_grads(model), _grads(ref)):
        assert rel_err(g, w / 2) <= 1e-10, rel_err(g, w / 2)


def test_deferred_ddp_syncs_once_with_uneven_batches():
    run(2, _ddp_worker, [5, 2])
