"""contrax.maxsim_loss (late interaction: ColBERT, ColPali, PyLate) through the
Python faces: over 1, 2 and 4 Gloo ranks with uneven batches (an empty rank
at W = 4), masks, ranks padding their documents to different lengths, hard
negatives, the symmetric form and a learnable scale, on the materialised,
tiled and ring paths, against a plain einsum + max reference on the
concatenated batch in fp64 to 1e-10; contrax.GradCache
over token towers, in one process and as DDP towers at W = 2 and 4; the
Module; torch.compile(fullgraph=True); the errors."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import contrax
from distributed import F64, offsets, rel_err, run

TOL = 1e-10
ROWS = {1: [5], 2: [4, 1], 4: [3, 0, 5, 2]}
LQ, LD, D = 3, 5, 4


def maxsim_ref(q, q_mask, d, d_mask):
    """Every token score of every pair at once, [n, m, Lq, Ld], reduced."""
    t = torch.einsum("iqd,jsd->ijqs", q, d).masked_fill(~d_mask[None, :, None, :], float("-inf"))
    return (t.max(-1).values * q_mask[:, None, :]).sum(-1)


def loss_ref(q, q_mask, d, d_mask, scale, symmetric=False, normalize_scores=False):
    scores = maxsim_ref(q, q_mask, d, d_mask)
    if normalize_scores:
        scores = scores / q_mask.sum(1, keepdim=True)
    logits = scores * scale
    n, g = logits.shape[0], logits.shape[1] // logits.shape[0]
    target = torch.arange(n) * g
    loss = F.cross_entropy(logits, target)
    return (loss + F.cross_entropy(logits.t(), target)) / 2 if symmetric else loss


def _batch(rows, g, seed):
    gen = torch.Generator().manual_seed(seed)
    B = sum(rows)
    q = torch.randn(B, LQ, D, generator=gen, dtype=F64)
    d = torch.randn(B * g, LD, D, generator=gen, dtype=F64)
    q_mask = torch.rand(B, LQ, generator=gen) > 0.3
    d_mask = torch.rand(B * g, LD, generator=gen) > 0.3
    q_mask[:, 0] = d_mask[:, 0] = True
    return q, q_mask, d, d_mask


def _check(rank, world, rows, g, memory=(), **kw):
    """``memory``: the memory-path arguments of the contrax call (``kw`` go to both)."""
    learnt = kw.pop("learnt", False)
    q, qm, d, dm = _batch(rows, g, seed=11 * g + len(rows))
    ref_q, ref_d = q.clone().requires_grad_(True), d.clone().requires_grad_(True)
    ref_s = torch.tensor(1.3, dtype=F64, requires_grad=True)
    ref = loss_ref(ref_q, qm, ref_d, dm, ref_s.exp() if learnt else 1 / 0.4, **kw)
    ref.backward()
    off, n = offsets(rows, rank)
    # Each rank pads its documents only to its own longest valid token.
    mine_dm = dm[off * g:(off + n) * g]
    length = int(mine_dm.nonzero()[:, 1].max()) + 1 if n else 1
    lq = q[off:off + n].clone().requires_grad_(True)
    ld = d[off * g:(off + n) * g, :length].clone().requires_grad_(True)
    ls = torch.tensor(1.3, dtype=F64, requires_grad=True)
    loss = contrax.maxsim_loss(lq, ld, ls if learnt else None, qm[off:off + n], mine_dm[:, :length],
                               temperature=0.4, panel_bytes=300, **dict(memory), **kw)
    loss.backward()
    packed = torch.stack([loss.detach(), ls.grad if learnt else torch.zeros((), dtype=F64)])
    if world > 1:
        dist.all_reduce(packed)
    packed /= world
    assert rel_err(packed[0], ref.detach()) <= TOL, (kw, packed[0].item(), ref.item())
    if learnt:
        assert rel_err(packed[1], ref_s.grad) <= TOL
    if n:
        assert rel_err(lq.grad / world, ref_q.grad[off:off + n]) <= TOL
        assert rel_err(ld.grad / world, ref_d.grad[off * g:(off + n) * g, :length]) <= TOL


def _worker(rank, world, rows):
    _check(rank, world, rows, 1)
    _check(rank, world, rows, 3, learnt=True, normalize_scores=True)
    _check(rank, world, rows, 1, symmetric=True, learnt=True)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_maxsim_loss_equals_the_einsum_reference(world):
    run(world, _worker, ROWS[world])


def _paths_worker(rank, world, rows):
    # Tiles of 2 queries x 2 documents: several steps per block.
    for path in (dict(path="tiled", tile_size=2), dict(tile_size=2, ring=True)):
        _check(rank, world, rows, 3, memory=path, learnt=True, normalize_scores=True)
        _check(rank, world, rows, 1, memory=path, symmetric=True)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tiled_and_ring_paths_equal_the_einsum_reference(world):
    run(world, _paths_worker, ROWS[world])


class TokenTower(torch.nn.Module):
    """Per-token Linear - tanh - Linear: [n, L, 6] -> [n, L, 4]."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def test_grad_cache_over_token_towers():
    torch.manual_seed(0)
    tower = TokenTower().double()
    gen = torch.Generator().manual_seed(2)
    xq, xd = torch.randn(7, 3, 6, generator=gen, dtype=F64), torch.randn(7, 5, 6, generator=gen, dtype=F64)
    ones_q, ones_d = torch.ones(7, 3, dtype=torch.bool), torch.ones(7, 5, dtype=torch.bool)
    loss_ref(tower(xq), ones_q, tower(xd), ones_d, 1 / 0.2).backward()
    want = [p.grad.clone() for p in tower.parameters()]
    tower.zero_grad()
    gc = contrax.GradCache([contrax.GradCacheEncoder(tower, 2), contrax.GradCacheEncoder(tower, 3)],
                           lambda q, d: contrax.maxsim_loss(q, d, temperature=0.2))
    gc.step(xq, xd)
    for p, w in zip(tower.parameters(), want):
        assert rel_err(p.grad, w) <= TOL


def _grad_cache_ranks(rank, world, rows, steps=2):
    """A query tower and a document tower under DDP in chunks of 2 and 3, with
    masks and uneven batches, against one process's full-batch step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ref_q, ref_d = TokenTower().double(), TokenTower().double()
    q_tower, d_tower = DDP(TokenTower().double()), DDP(TokenTower().double())
    q_tower.module.load_state_dict(ref_q.state_dict())
    d_tower.module.load_state_dict(ref_d.state_dict())
    off, n = offsets(rows, rank)
    for step in range(steps):
        gen = torch.Generator().manual_seed(7 + step)
        B = sum(rows)
        xq, xd = torch.randn(B, LQ, 6, generator=gen, dtype=F64), torch.randn(B, LD, 6, generator=gen, dtype=F64)
        qm, dm = torch.rand(B, LQ, generator=gen) > 0.3, torch.rand(B, LD, generator=gen) > 0.3
        qm[:, 0] = dm[:, 0] = True
        ref_loss = loss_ref(ref_q(xq), qm, ref_d(xd), dm, 1 / 0.2)
        ref_loss.backward()
        gc = contrax.GradCache([contrax.GradCacheEncoder(q_tower, 2), contrax.GradCacheEncoder(d_tower, 3)],
                               lambda q, d: contrax.maxsim_loss(q, d, None, qm[off:off + n], dm[off:off + n],
                                                                temperature=0.2))
        total = gc.step(xq[off:off + n], xd[off:off + n]).detach().clone()
        dist.all_reduce(total)
        assert rel_err(total / world, ref_loss.detach()) <= TOL
        for tower, ref in ((q_tower.module, ref_q), (d_tower.module, ref_d)):
            # Over each tower's whole gradient: the document tower's output bias shifts every
            # score of a query's row alike, so its gradient is 0 up to rounding in both.
            got, want = (torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (tower, ref))
            assert rel_err(got, want) <= TOL, (rank, step)
            tower.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("world", [2, 4])
def test_grad_cache_over_token_towers_across_ranks(world):
    run(world, _grad_cache_ranks, ROWS[world])


def test_module_and_compile():
    q, qm, d, dm = _batch([4], 2, seed=3)
    q.requires_grad_(True)
    m = contrax.MaxSimLoss(temperature=0.5)
    assert m.logit_scale is None and "temperature=0.5" in repr(m)
    want = loss_ref(q, qm, d, dm, 2.0)
    assert rel_err(m(q, d, qm, dm), want) <= TOL
    learnt = contrax.MaxSimLoss(init_scale=8.0)
    assert [n for n, _ in learnt.named_parameters()] == ["logit_scale"]
    # fullgraph=True: a graph break is an error; the operators' backward equals eager.
    step = torch.compile(lambda x: contrax.maxsim_loss(x, d, None, qm, dm, temperature=0.5), fullgraph=True)
    got = step(q)
    assert rel_err(got, want) <= TOL
    assert rel_err(torch.autograd.grad(got, q)[0], torch.autograd.grad(want, q)[0]) <= TOL


def test_argument_errors():
    q, d = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match=r"maxsim_loss\(\): argument 'queries' must be a 3-D tensor \[rows, tokens, "
                                         r"width\], but got shape \[2, 4\]"):
        contrax.maxsim_loss(torch.randn(2, 4), d)
    with pytest.raises(ValueError, match=r"argument 'query_mask' must be a bool tensor \[2, 3\]"):
        contrax.maxsim_loss(q, d, query_mask=torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"maxsim_loss\(\): argument 'document_mask' must be a Tensor or None, but "
                                        r"got list"):
        contrax.maxsim_loss(q, d, document_mask=[[True] * 5] * 2)
    with pytest.raises(TypeError, match=r"maxsim_loss\(\): argument 'panel_bytes' must be an integer, but got float"):
        contrax.maxsim_loss(q, d, panel_bytes=1.5)
    with pytest.raises(ValueError, match=r"argument 'symmetric' needs one document per query, but got g = 2"):
        contrax.maxsim_loss(q, torch.randn(4, 5, 4), symmetric=True)
    with pytest.raises(ValueError, match=r"maxsim_loss\(\): argument 'path' must be 'auto', 'materialised' or "
                                         r"'tiled', but got 'ring'"):
        contrax.maxsim_loss(q, d, path="ring")
