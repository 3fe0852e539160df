"""Binding losses and gradients over 1, 2 and 4 Gloo ranks with uneven batches
equal a plain single-process PyTorch computation on the concatenated batch."""
import zlib

import pytest
import torch
import torch.distributed as dist

import contrax
from distributed import F64, clip_ref, moco_v3_ref, nt_xent_ref, offsets, rel_err, run

TOL = 1e-10
ROWS = {1: [5], 2: [4, 1], 4: [3, 0, 5, 2]}  # uneven, with an empty rank at W=4
WIDTH = 6


def _global(seed, n, rows):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(rows), WIDTH, generator=g, dtype=F64) for _ in range(n)]


def _check(rank, world, rows, name, ref_fn, dist_fn, n_features, scalars=(), grad_features=None, group=None):
    """Reference on the whole batch vs this rank's share through `dist_fn`,
    under the data-parallel convention: the rank average of the loss and of
    scalar gradients, and local feature gradients / W, equal the reference."""
    grad_features = grad_features or [True] * n_features
    xs = _global(zlib.crc32(name.encode()), n_features, rows)
    ref_x = [x.clone().requires_grad_(g) for x, g in zip(xs, grad_features)]
    ref_s = [torch.tensor(v, dtype=F64, requires_grad=True) for v in scalars]
    ref_loss = ref_fn(*ref_x, *ref_s)
    ref_loss.backward()

    off, n = offsets(rows, rank)
    loc_x = [x[off:off + n].clone().requires_grad_(g) for x, g in zip(xs, grad_features)]
    loc_s = [torch.tensor(v, dtype=F64, requires_grad=True) for v in scalars]
    loss = dist_fn(*loc_x, *loc_s)
    assert loss.dim() == 0 and loss.dtype == F64
    loss.backward()

    packed = torch.stack([loss.detach()] + [s.grad if s.grad is not None else torch.zeros((), dtype=F64)
                                            for s in loc_s])
    if world > 1:
        dist.all_reduce(packed, group=group)
    packed /= world
    assert rel_err(packed[0], ref_loss.detach()) <= TOL, (name, "loss", packed[0].item(), ref_loss.item())
    for k, s in enumerate(ref_s):
        want = s.grad
        got = packed[k + 1]
        err = (got - want).abs().item() if want.abs().item() < 1e-12 else rel_err(got, want)
        assert err <= TOL, (name, "scalar grad", k, got.item(), want.item())
    for k, (x, g) in enumerate(zip(loc_x, grad_features)):
        if not g:
            assert x.grad is None
            continue
        got = x.grad / world
        want = ref_x[k].grad[off:off + n]
        assert got.shape == want.shape, (name, "feature grad shape", k)
        if n > 0:  # an empty rank's [0, d] gradient has no entries to compare
            assert rel_err(got, want) <= TOL, (name, "feature grad", k)


def _losses_worker(rank, world, rows):
    cases = [
        ("clip", lambda a, b, s: clip_ref(a, b, s),
         lambda a, b, s: contrax.clip_loss(a, b, s), 2, [2.3]),
        ("clip_bias_norm", lambda a, b, s, t: clip_ref(a, b, s, t, normalize=True),
         lambda a, b, s, t: contrax.clip_loss(a, b, s, t, normalize=True), 2, [1.7, -0.4]),
        ("clip_clamped_asym", lambda a, b, s: clip_ref(a, b, s, symmetric=False, max_logit_scale=5.0),
         lambda a, b, s: contrax.clip_loss(a, b, s, symmetric=False, max_logit_scale=5.0), 2, [2.0]),
        ("nt_xent", lambda a, b: nt_xent_ref(a, b, 0.2),
         lambda a, b: contrax.nt_xent_loss(a, b, temperature=0.2), 2, []),
        ("nt_xent_raw", lambda a, b: nt_xent_ref(a, b, 0.7, normalize=False),
         lambda a, b: contrax.nt_xent_loss(a, b, temperature=0.7, normalize=False), 2, []),
    ]
    for name, ref_fn, dist_fn, n, scalars in cases:
        _check(rank, world, rows, name, ref_fn, dist_fn, n, scalars)
    # MoCo v3: keys are constants (no gradient flows to them).
    _check(rank, world, rows, "moco_v3",
           lambda q1, q2, k1, k2: moco_v3_ref(q1, q2, k1, k2, 0.2),
           lambda q1, q2, k1, k2: contrax.moco_v3_loss(q1, q2, k1, k2, temperature=0.2),
           4, grad_features=[True, True, False, False])
    # Explicit group= (the default group object) gives the same answer.
    _check(rank, world, rows, "clip_explicit_group", lambda a, b, s: clip_ref(a, b, s),
           lambda a, b, s: contrax.clip_loss(a, b, s, group=dist.group.WORLD), 2, [2.3])

    # gather_with_grad / gather_no_grad: rows in rank order, reduce-scatter-sum backward.
    (x_all,) = _global(7, 1, rows)
    off, n = offsets(rows, rank)
    x = x_all[off:off + n].clone().requires_grad_(True)
    got, counts, offset = contrax.gather_with_grad(x, return_counts=True)
    assert counts == rows and offset == off
    assert torch.equal(got, x_all)
    weights = torch.arange(sum(rows) * WIDTH, dtype=F64).reshape(-1, WIDTH)
    (got * weights * (rank + 1)).sum().backward()
    want = weights[off:off + n] * (world * (world + 1) / 2)
    assert torch.allclose(x.grad, want, rtol=0, atol=0)
    nog = contrax.gather_no_grad(x)
    assert torch.equal(nog, x_all) and not nog.requires_grad

    _variants_worker(rank, world, rows)

    # Communicators are cached per group.
    assert contrax.communicator() is contrax.communicator(dist.group.WORLD)
    assert contrax.communicator().world_size == world and contrax.communicator().rank == rank


def _subgroup_worker(rank, world):
    # Two disjoint groups {0, 1} and {2, 3}; each computes its own exact loss.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    sub_rows = [3, 2] if rank < 2 else [1, 4]
    sub_rank = rank % 2
    _check(sub_rank, 2, sub_rows, f"clip_subgroup_{rank // 2}", lambda a, b, s: clip_ref(a, b, s),
           lambda a, b, s: contrax.clip_loss(a, b, s, group=mine), 2, [1.1], group=mine)
    c = contrax.communicator(mine)
    assert c.world_size == 2 and c.rank == sub_rank
    assert c.stats()["all_gather"]["calls"] >= 1


@pytest.mark.parametrize("world", [1, 2, 4])
def test_losses_match_single_process(world):
    run(world, _losses_worker, ROWS[world])


def test_subgroups():
    run(4, _subgroup_worker)


def _static_shapes_worker(rank, world):
    # Equal batches under Communicator.static_shapes: the same exact losses,
    # and no metadata exchange (the row counts are taken as known).
    c = contrax.communicator()
    assert c.static_shapes is False
    c.static_shapes = True
    try:
        c.reset_stats()
        rows = [3] * world
        _check(rank, world, rows, "clip_static", lambda a, b, s: clip_ref(a, b, s),
               lambda a, b, s: contrax.clip_loss(a, b, s), 2, [2.3])
        _check(rank, world, rows, "nt_xent_static", lambda a, b: nt_xent_ref(a, b, 0.2),
               lambda a, b: contrax.nt_xent_loss(a, b, temperature=0.2, path="tiled", ring=True), 2, [])
        assert "metadata" not in c.stats(), c.stats()
    finally:
        c.static_shapes = False
    contrax.clip_loss(torch.randn(3, WIDTH), torch.randn(3, WIDTH), torch.tensor(1.0))
    assert c.stats()["metadata"]["calls"] == 1


def test_static_shapes():
    run(2, _static_shapes_worker)


def test_without_torch_distributed_is_single_device():
    assert not dist.is_initialized()
    rows = [6]
    _check(0, 1, rows, "clip_nodist", lambda a, b, s, t: clip_ref(a, b, s, t),
           lambda a, b, s, t: contrax.clip_loss(a, b, s, t), 2, [2.3, 0.1])
    _check(0, 1, rows, "nt_xent_nodist", nt_xent_ref, contrax.nt_xent_loss, 2)
    _check(0, 1, rows, "moco_nodist", moco_v3_ref, contrax.moco_v3_loss, 4,
           grad_features=[True, True, False, False])
    x = torch.randn(3, 2, requires_grad=True)
    assert torch.equal(contrax.gather_with_grad(x), x)
    assert contrax.communicator().world_size == 1


def test_float32_and_momentum_helpers():
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    s = torch.tensor(1.0, requires_grad=True)
    loss = contrax.clip_loss(a, b, s)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, clip_ref(a, b, s))
    assert contrax.momentum_schedule(0.99, 0, 10) == pytest.approx(0.99)
    assert contrax.momentum_schedule(0.99, 10, 10) == pytest.approx(1.0)
    t, o = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    want = 0.9 * t.weight.detach() + 0.1 * o.weight.detach()
    contrax.momentum_update(t, o, 0.9)
    torch.testing.assert_close(t.weight.detach(), want)


# The CPU, and CUDA where this machine has a GPU.
ON_CPU_AND_CUDA = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA case runs on a GPU only"))]

# Relative tolerance of the loss for fp16/bf16 features against the fp64
# reference on the same rounded inputs. On the CPU the engine computes in fp32:
# only fp32 accumulation remains. On CUDA the normalised features are gathered
# and multiplied in their own dtype (engine/precision.h), so their rounding
# after the normalisation counts too.
REDUCED_TOLERANCE = {("cpu", torch.float16): 1e-5, ("cpu", torch.bfloat16): 1e-5,
                     ("cuda", torch.float16): 3e-3, ("cuda", torch.bfloat16): 2e-2}


@pytest.mark.parametrize("device", ON_CPU_AND_CUDA)
def test_half_and_bfloat16_accumulate_in_float32(device):
    """fp16/bf16 features (what GPU training feeds) are computed with fp32
    log-sum-exps; on CPU they used to fail inside ATen. The reference sees the
    same rounded inputs in fp64."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16):
        tol = REDUCED_TOLERANCE[(device, dtype)]
        for path in ("materialised", "tiled"):
            a = torch.randn(6, 8, generator=g).to(dtype).to(device).requires_grad_(True)
            b = torch.randn(6, 8, generator=g).to(dtype).to(device)
            s = torch.tensor(2.0, device=device, requires_grad=True)
            loss = contrax.clip_loss(a, b, s, normalize=True, path=path, tile_size=4 if path == "tiled" else 0)
            assert loss.dtype == torch.float32
            loss.backward()
            assert a.grad.dtype == dtype
            a64, b64 = a.detach().cpu().double(), b.cpu().double()
            ref = clip_ref(a64, b64, torch.tensor(2.0, dtype=F64), normalize=True)
            assert abs(loss.item() - ref.item()) <= tol * ref.item(), (device, dtype, path)
            nt = contrax.nt_xent_loss(a.detach(), b, temperature=0.5, path=path, tile_size=4 if path == "tiled" else 0)
            nt_ref = nt_xent_ref(a64, b64, 0.5).item()
            assert abs(nt.item() - nt_ref) <= tol * nt_ref, (device, dtype, path)


def _variants_worker(rank, world, rows):
    from distributed import siglip_ref
    for ring in (False, True):
        _check(rank, world, rows, f"tiled_clip_ring{ring}",
               lambda a, b, s, t: clip_ref(a, b, s, t, normalize=True),
               lambda a, b, s, t: contrax.clip_loss(a, b, s, t, normalize=True, path="tiled", tile_size=2,
                                                            ring=ring),
               2, [1.7, -0.4])
        _check(rank, world, rows, f"tiled_nt_xent_ring{ring}", lambda a, b: nt_xent_ref(a, b, 0.3),
               lambda a, b: contrax.nt_xent_loss(a, b, temperature=0.3, path="tiled", tile_size=2,
                                                    ring=ring), 2)
        _check(rank, world, rows, f"tiled_moco_ring{ring}",
               lambda q1, q2, k1, k2: moco_v3_ref(q1, q2, k1, k2, 0.2),
               lambda q1, q2, k1, k2: contrax.moco_v3_loss(q1, q2, k1, k2, temperature=0.2, path="tiled",
                                                          tile_size=2, ring=ring),
               4, grad_features=[True, True, False, False])
    for kw in ({"tile_size": 2}, {"path": "materialised"}, {"path": "tiled", "tile_size": 2},
               {"tile_size": 2, "ring": True}):
        _check(rank, world, rows, f"siglip {kw}", lambda a, b, s, t: siglip_ref(a, b, s, t),
               lambda a, b, s, t: contrax.siglip_loss(a, b, s, t, **kw), 2, [1.2, -2.0])



def test_memory_path_vocabulary():
    """Every loss takes path="auto" | "materialised" | "tiled" and tile_size (the
    tile side); all paths give the same value and gradients (fp64); the old
    tile_size=-1, past its release, is an error naming path="materialised"'s
    C++ spelling."""
    g = torch.Generator().manual_seed(5)
    a0 = torch.randn(40, 8, generator=g, dtype=F64)
    b0 = torch.randn(40, 8, generator=g, dtype=F64)
    s = torch.tensor(1.0, dtype=F64)
    calls = {
        "clip_loss": lambda a, b, **kw: contrax.clip_loss(a, b, s, **kw),
        "grouped_loss": lambda a, b, **kw: contrax.grouped_loss(a, b, s, **kw),
        "nt_xent_loss": lambda a, b, **kw: contrax.nt_xent_loss(a, b, **kw),
        "moco_v3_loss": lambda a, b, **kw: contrax.moco_v3_loss(a, b, b, a, **kw),
        "siglip_loss": lambda a, b, **kw: contrax.siglip_loss(a, b, s, **kw),
    }
    for name, fn in calls.items():
        results = []
        # "materialized" is accepted as an alias, which the error does not list.
        for kw in ({"path": "materialised"}, {"path": "tiled", "tile_size": 8}, {"path": "auto"},
                   {"tile_size": 16}, {"path": "materialized"}):
            a = a0.clone().requires_grad_(True)
            loss = fn(a, b0, **kw)
            loss.backward()
            results.append((loss.detach(), a.grad))
        for loss, grad in results[1:]:
            torch.testing.assert_close(loss, results[0][0], rtol=1e-12, atol=1e-12, msg=name)
            torch.testing.assert_close(grad, results[0][1], rtol=1e-12, atol=1e-12, msg=name)
        with pytest.raises(ValueError, match=name + r"\(\): argument 'path' must be 'auto', 'materialised' or "
                                                    r"'tiled', but got 'fast'"):
            fn(a0, b0, path="fast")
    with pytest.raises(ValueError, match=r"clip_loss\(\): argument 'tile_size' must be >= 0 .*the materialised path "
                                         r"is path kMaterialised\), but got -1"):
        contrax.clip_loss(a0, b0, s, tile_size=-1)


def test_kept_loss_workspace():
    # [3000 x 3000] fp32 logits (34 MB) are above the 32 MiB threshold.
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(3000, 8, generator=g), torch.randn(3000, 8, generator=g)
    scale = torch.tensor(2.0)

    def once():
        x, y = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        loss = contrax.clip_loss(x, y, scale, path="materialised")
        loss.backward()
        return loss.detach(), x.grad

    contrax.release_loss_workspace()
    contrax.set_keep_loss_workspace(True)
    first = once()
    assert contrax.loss_workspace_bytes() == 3000 * 3000 * 4
    second = once()
    contrax.set_keep_loss_workspace(False)
    assert contrax.loss_workspace_bytes() == 0
    third = once()
    assert contrax.loss_workspace_bytes() == 0
    contrax.set_keep_loss_workspace(True)
    for x, y, z in zip(first, second, third):
        assert torch.equal(x, y) and torch.equal(x, z)
    contrax.release_loss_workspace()
    assert contrax.loss_workspace_bytes() == 0


@pytest.mark.parametrize("device", ON_CPU_AND_CUDA)
@pytest.mark.parametrize("name", ["clip", "clip_tiled", "nt_xent", "moco_v3", "grouped", "siglip"])
def test_autocast_changes_no_loss_or_gradient(name, device):
    # Issue 28, item 3: the engine's GEMMs ran in bf16 under torch.autocast
    # before; the loss and its gradients are now the same wherever forward and
    # backward are called.
    torch.manual_seed(5)
    base = [torch.randn(7, 6) for _ in range(4)] + [torch.randn(14, 6), torch.tensor(2.0), torch.tensor(-2.0)]
    base = [t.to(device) for t in base]
    call = {
        "clip": lambda x: contrax.clip_loss(x[0], x[1], x[5], normalize=True),
        "clip_tiled": lambda x: contrax.clip_loss(x[0], x[1], x[5], x[6], path="tiled", tile_size=3),
        "nt_xent": lambda x: contrax.nt_xent_loss(x[0], x[1]),
        "moco_v3": lambda x: contrax.moco_v3_loss(x[0], x[1], x[2], x[3]),
        "grouped": lambda x: contrax.grouped_loss(x[0], x[4], x[5], x[6]),
        "siglip": lambda x: contrax.siglip_loss(x[0], x[1], x[5], x[6], tile_size=3),
    }[name]
    runs = []
    for fwd_inside in (False, True):
        for bwd_inside in (False, True):
            leaves = [t.clone().requires_grad_(True) for t in base]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=fwd_inside):
                loss = call(leaves)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bwd_inside):
                loss.backward()
            runs.append((loss.detach(), [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]))
    for loss, grads in runs[1:]:
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, runs[0][0], rtol=1e-6, atol=1e-7)
        for g, g0 in zip(grads, runs[0][1]):
            torch.testing.assert_close(g, g0, rtol=1e-6, atol=1e-7)
