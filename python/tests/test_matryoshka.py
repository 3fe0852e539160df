"""Matryoshka prefixes (``matryoshka_dims`` / ``matryoshka_weights``) through
the Python faces: every loss over 1, 2 and 4 Gloo ranks with uneven batches
(an empty rank at W = 4) against a plain loop over prefixes of the
single-process references, in fp64 to 1e-10, on the materialised, tiled and
ring paths; ``contrax.GradCache`` with DDP towers; the Modules;
``torch.compile(fullgraph=True)`` (no graph break); the argument errors."""
import pytest
import torch
import torch.distributed as dist

import contrax
from distributed import F64, clip_ref, matryoshka_ref, moco_v3_ref, nt_xent_ref, offsets, rel_err, run, siglip_ref
from test_grad_cache import HashDropoutTower, LogitScale, _assert_grads_equal, _counted_ddp, _global_batch, \
    _grads, _plain_step_calls
from test_grouped import grouped_rows_ref
from test_losses import ROWS, TOL, _check

DIMS, WEIGHTS = [3, 2], [0.5, 2.0]  # listed widest first, as sentence-transformers does; the width is 6
M = {"matryoshka_dims": DIMS, "matryoshka_weights": WEIGHTS}


def _ref(loss):
    """The reference over prefixes of a loss of the features (scalars follow them)."""
    def fn(*args):
        n = len(args) - len(fn.scalars)
        return matryoshka_ref(lambda *f: loss(*f, *args[n:]), DIMS, WEIGHTS, *args[:n])
    return fn


def _losses(rank, world, rows):
    for kw in ({}, {"path": "tiled", "tile_size": 2}, {"tile_size": 2, "ring": True}):
        ref = _ref(lambda a, b, s, t: clip_ref(a, b, s, t))
        ref.scalars = [1.7, -0.4]
        _check(rank, world, rows, f"clip {kw}", ref, lambda a, b, s, t: contrax.clip_loss(a, b, s, t, **M, **kw),
               2, ref.scalars)
        ref = _ref(lambda a, b: nt_xent_ref(a, b, 0.3))
        ref.scalars = []
        _check(rank, world, rows, f"nt_xent {kw}", ref,
               lambda a, b: contrax.nt_xent_loss(a, b, temperature=0.3, **M, **kw), 2)
    ref = _ref(lambda q1, q2, k1, k2: moco_v3_ref(q1, q2, k1, k2, 0.2))
    ref.scalars = []
    _check(rank, world, rows, "moco_v3", ref,
           lambda q1, q2, k1, k2: contrax.moco_v3_loss(q1, q2, k1, k2, temperature=0.2, **M), 4,
           grad_features=[True, True, False, False])
    ref = _ref(lambda a, b, s, t: siglip_ref(a, b, s, t))
    ref.scalars = [1.2, -2.0]
    _check(rank, world, rows, "siglip", ref, lambda a, b, s, t: contrax.siglip_loss(a, b, s, t, tile_size=2, **M),
           2, ref.scalars)
    # Grouped: one positive per query here (the table's g > 1 cases are C++'s).
    ref = _ref(lambda q, c, s: grouped_rows_ref(q, c, s).mean())
    ref.scalars = [2.0]
    _check(rank, world, rows, "grouped", ref, lambda q, c, s: contrax.grouped_loss(q, c, s, **M), 2, ref.scalars)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_loss_over_prefixes_equals_the_loop(world):
    run(world, _losses, ROWS[world])


def _grad_cache(rank, world, rows, steps=2):
    """One DDP tower for both views in chunks of 2 and 3, the loss over the
    tower's 4 features cut at 1 and 2, against one single-process step."""
    tower_calls, scale_calls = _plain_step_calls()
    torch.manual_seed(3)
    ref_tower, ref_scale = HashDropoutTower(6, salt=5).double(), LogitScale()
    (tower, tower_count), (scale, _) = _counted_ddp(HashDropoutTower(6, salt=5).double()), _counted_ddp(LogitScale())
    tower.module.load_state_dict(ref_tower.state_dict())
    gc = contrax.GradCache([contrax.GradCacheEncoder(tower, 2), contrax.GradCacheEncoder(tower, 3)],
                           lambda z1, z2: contrax.clip_loss(z1, z2, scale(), matryoshka_dims=[2, 1]))
    off, n = offsets(rows, rank)
    for step in range(steps):
        x, _, ids = _global_batch(step, rows)
        x2 = x.flip(1) + 0.1 * x
        ref_loss = matryoshka_ref(lambda a, b: clip_ref(a, b, ref_scale()), [2, 1], [],
                                  ref_tower(x, ids), ref_tower(x2, ids + 500))
        ref_loss.backward()
        loss = gc.step([x[off:off + n], ids[off:off + n]], [x2[off:off + n], ids[off:off + n] + 500])
        total = loss.clone()
        if world > 1:
            dist.all_reduce(total)
        assert rel_err(total / world, ref_loss.detach()) <= TOL
        _assert_grads_equal(_grads(tower.module, scale.module), _grads(ref_tower, ref_scale), what=("step", step))
        assert tower_count["calls"] == tower_calls * (step + 1)  # one synchronisation per step, all prefixes
        for m in (tower.module, scale.module, ref_tower, ref_scale):
            m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("world,rows", [(1, [7]), (2, [7, 3]), (4, [5, 0, 6, 2])])
def test_grad_cache_over_prefixes_equals_the_big_batch_step(world, rows):
    run(world, _grad_cache, rows)


def test_modules_and_compile():
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randn(5, 6, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    m = contrax.ClipLoss(init_scale=8.0, **M)
    assert "matryoshka_dims=(3, 2), matryoshka_weights=(0.5, 2.0)" in repr(m)
    log_scale = m.logit_scale.detach().double()  # the Module casts its fp32 parameter to the features' dtype
    want = matryoshka_ref(lambda x, y: clip_ref(x, y, log_scale), DIMS, WEIGHTS, a, b)
    assert rel_err(m(a, b), want) <= TOL
    assert rel_err(contrax.NTXentLoss(matryoshka_dims=(2,))(a, b),
                   matryoshka_ref(nt_xent_ref, [2], [], a, b)) <= TOL
    # fullgraph=True: a graph break is an error; the operators' backward equals eager.
    step = torch.compile(lambda x, y: contrax.clip_loss(x, y, log_scale, **M), fullgraph=True)
    got = step(a, b)
    (ga, gb) = torch.autograd.grad(got, (a, b))
    (wa, wb) = torch.autograd.grad(want, (a, b))
    assert rel_err(got, want) <= TOL and rel_err(ga, wa) <= TOL and rel_err(gb, wb) <= TOL


def test_argument_errors():
    a, s = torch.randn(4, 6), torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"clip_loss\(\): argument 'matryoshka_dims' must be a sequence of integers, "
                                        r"but got int"):
        contrax.clip_loss(a, a, s, matryoshka_dims=3)
    with pytest.raises(TypeError, match=r"siglip_loss\(\): argument 'matryoshka_weights' must be a sequence of "
                                        r"numbers, but got str"):
        contrax.siglip_loss(a, a, s, matryoshka_dims=[2], matryoshka_weights="1")
    with pytest.raises(TypeError, match=r"NTXentLoss\(\): argument 'matryoshka_dims' must be a sequence of integers, "
                                        r"but got list"):
        contrax.NTXentLoss(matryoshka_dims=[2.5])
    with pytest.raises(ValueError, match=r"grouped_loss\(\): argument 'matryoshka_dims' must hold widths in \[1, 6\] "
                                         r"\(the features' width\), but got 7"):
        contrax.grouped_loss(a, a, s, matryoshka_dims=[7])
    with pytest.raises(ValueError, match=r"nt_xent_loss\(\): argument 'matryoshka_weights' must hold one weight per "
                                         r"entry of 'matryoshka_dims' \(1\) or none, but got 2"):
        contrax.nt_xent_loss(a, a, matryoshka_dims=[2], matryoshka_weights=[1, 2])
