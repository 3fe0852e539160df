"""grouped_loss (hard negatives), labels and reductions through the binding,
over 1 and 2 Gloo ranks with uneven batches (and an empty rank), against a
plain single-process PyTorch computation on the concatenated batch."""
import math
import warnings

import pytest
import torch
import torch.distributed as dist

import contrax
from distributed import F64, offsets, rel_err, run, spawn

TOL = 1e-10
D = 5


def _rows_ref(q, k, log_scale, bias, designated, equal, mode):
    """Per-row InfoNCE: designated [R, C] bool positives, equal [R, C] label
    equality or None; mode 'mask_duplicates' or 'multi_positive'."""
    logits = q @ k.t() * log_scale.exp().clamp(max=100.0)
    if bias is not None:
        logits = logits + bias
    pos, masked = designated, None
    if equal is not None:
        if mode == "multi_positive":
            pos = designated | equal
        else:
            masked = equal & ~designated
    kept = logits if masked is None else logits.masked_fill(masked, -math.inf)
    return torch.logsumexp(kept, 1) - torch.where(pos, logits, torch.zeros_like(logits)).sum(1) / pos.sum(1)


def grouped_rows_ref(q, c, s, bias=None, labels=None, cand_labels=None, mode="mask_duplicates"):
    B, N = q.shape[0], c.shape[0]
    g = N // B
    designated = torch.arange(N).unsqueeze(0) == (torch.arange(B) * g).unsqueeze(1)
    equal = None if labels is None else labels.unsqueeze(1) == cand_labels.unsqueeze(0)
    return _rows_ref(q, c, s, bias, designated, equal, mode)


def clip_rows_ref(a, b, s, labels=None, mode="multi_positive", symmetric=True):
    eye = torch.eye(a.shape[0], dtype=torch.bool)
    equal = None if labels is None else labels.unsqueeze(1) == labels.unsqueeze(0)
    rows = _rows_ref(a, b, s, None, eye, equal, mode)
    if not symmetric:
        return rows
    logits_t_rows = _rows_ref(b, a, s, None, eye, equal, mode)  # column j of a b^T = row j of b a^T
    return (rows + logits_t_rows) / 2


def _data(B, g, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, D, generator=gen, dtype=F64)
    c = torch.randn(B * g, D, generator=gen, dtype=F64)
    labels = torch.randint(0, max(2, B // 2), (B,), generator=gen)
    cand = torch.randint(0, max(2, B // 2), (B * g,), generator=gen)
    cand.view(B, g)[:, 0] = labels
    up = torch.randn(B, generator=gen, dtype=F64)
    return q, c, labels, cand, up


def _check(rank, world, rows, name, g, ref_rows_fn, loss_fn, reduction):
    """ref_rows_fn(q, c, s, labels, cand) -> [B]; loss_fn(q, c, s, labels, cand, reduction) on this rank."""
    B = sum(rows)
    q, c, labels, cand, up = _data(B, g, 5)
    rq, rc = q.clone().requires_grad_(True), c.clone().requires_grad_(True)
    rs = torch.tensor(1.2, dtype=F64, requires_grad=True)
    ref_rows = ref_rows_fn(rq, rc, rs, labels, cand)
    R = {"mean": ref_rows.mean(), "sum": ref_rows.sum(), "none": (ref_rows * up).sum()}[reduction]
    R.backward()
    factor = 1.0 if reduction == "none" else float(world)

    off, n = offsets(rows, rank)
    lq = q[off:off + n].clone().requires_grad_(True)
    lc = c[off * g:(off + n) * g].clone().requires_grad_(True)
    ls = torch.tensor(1.2, dtype=F64, requires_grad=True)
    out = loss_fn(lq, lc, ls, labels[off:off + n], cand[off * g:(off + n) * g], reduction)
    if reduction == "none":
        assert out.shape == (n,), (name, out.shape)
        if n:
            assert rel_err(out.detach(), ref_rows.detach()[off:off + n]) <= TOL, (name, "rows")
        out.backward(up[off:off + n])
    else:
        assert out.dim() == 0
        out.backward()
    packed = torch.stack([out.detach().sum() if reduction != "none" else torch.zeros((), dtype=F64), ls.grad])
    if world > 1:
        dist.all_reduce(packed)
    if reduction != "none":
        assert rel_err(packed[0] / world, R.detach()) <= TOL, (name, "value")
        assert rel_err(packed[1] / world, rs.grad) <= TOL, (name, "dscale")
    else:
        assert rel_err(packed[1], rs.grad) <= TOL, (name, "dscale")
    if n:
        assert rel_err(lq.grad, rq.grad[off:off + n] * factor) <= TOL, (name, "dq")
        assert rel_err(lc.grad, rc.grad[off * g:(off + n) * g] * factor) <= TOL, (name, "dc")


def _worker(rank, world, rows):
    for reduction in ("mean", "sum", "none"):
        for g in (1, 3):
            _check(rank, world, rows, f"grouped_g{g}", g,
                   lambda q, c, s, l, cl: grouped_rows_ref(q, c, s),
                   lambda q, c, s, l, cl, r: contrax.grouped_loss(q, c, s, reduction=r), reduction)
        for mode in ("mask_duplicates", "multi_positive"):
            for path, tile in (("materialised", 0), ("tiled", 2)):
                _check(rank, world, rows, f"grouped_{mode}_{path}", 2,
                       lambda q, c, s, l, cl: grouped_rows_ref(q, c, s, None, l, cl, mode),
                       lambda q, c, s, l, cl, r: contrax.grouped_loss(
                           q, c, s, labels=l, candidate_labels=cl, label_mode=mode, reduction=r, path=path,
                           tile_size=tile),
                       reduction)
            for symmetric in (True, False):
                _check(rank, world, rows, f"clip_{mode}_{symmetric}", 1,
                       lambda q, c, s, l, cl: clip_rows_ref(q, c, s, l, mode, symmetric),
                       lambda q, c, s, l, cl, r: contrax.clip_loss(
                           q, c, s, labels=l, label_mode=mode, reduction=r, symmetric=symmetric),
                       reduction)


@pytest.mark.parametrize("world,rows", [(1, [6]), (2, [5, 2]), (2, [0, 4])])
def test_grouped_and_labels_match_single_process(world, rows):
    if world == 1:
        _worker(0, 1, rows)
    else:
        run(world, _worker, rows)


def test_reductions_of_nt_xent_and_moco():
    gen = torch.Generator().manual_seed(3)
    z1, z2, k1, k2 = (torch.randn(4, D, generator=gen, dtype=F64) for _ in range(4))
    m = contrax.nt_xent_loss(z1, z2)
    assert rel_err(contrax.nt_xent_loss(z1, z2, reduction="sum"), 4 * m) <= TOL
    per_example = contrax.nt_xent_loss(z1, z2, reduction="none")
    assert per_example.shape == (4,) and rel_err(per_example.mean(), m) <= TOL
    mo = contrax.moco_v3_loss(z1, z2, k1, k2, temperature=0.2)
    rows = contrax.moco_v3_loss(z1, z2, k1, k2, temperature=0.2, reduction="none")
    assert rows.shape == (4,) and rel_err(rows.mean(), mo) <= TOL
    assert rel_err(contrax.moco_v3_loss(z1, z2, k1, k2, temperature=0.2, reduction="sum"), 4 * mo) <= TOL


def test_errors():
    q, c, s = torch.randn(3, D), torch.randn(7, D), torch.tensor(1.0)
    with pytest.raises(ValueError, match="argument 'candidates' must have g \\* queries.size\\(0\\) rows"):
        contrax.grouped_loss(q, c, s)
    with pytest.raises(ValueError, match="argument 'reduction' must be 'mean', 'sum' or 'none', but got 'avg'"):
        contrax.grouped_loss(q, torch.randn(6, D), s, reduction="avg")
    with pytest.raises(ValueError, match="argument 'label_mode' must be 'multi_positive' or 'mask_duplicates'"):
        contrax.clip_loss(q, q, s, labels=torch.zeros(3, dtype=torch.long), label_mode="mask")
    with pytest.raises(ValueError, match="argument 'labels' must be an int64 tensor"):
        contrax.clip_loss(q, q, s, labels=torch.zeros(3))
    with pytest.raises(ValueError, match="argument 'labels' needs 'candidate_labels'"):
        contrax.grouped_loss(q, torch.randn(6, D), s, labels=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="argument 'reduction' must be 'mean', 'sum' or 'none', but got 'mean '"):
        contrax.nt_xent_loss(q, q, reduction="mean ")


def _warn_worker(rank, world):
    a = torch.randn(3, D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        contrax.clip_loss(a, a, torch.tensor(2.66))  # log(1/0.07): fine
        contrax.grouped_loss(a, a, torch.tensor(math.log(100.0) + 0.5))  # clamped, but not the mistake
        assert not caught, [str(w.message) for w in caught]
        for _ in range(3):
            contrax.grouped_loss(a, a, torch.tensor(1 / 0.07))
            contrax.clip_loss(a, a, torch.tensor(100.0))
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "logit_scale=14.2857 is the log of the scale" in str(caught[0].message)
    assert "not 1/0.07=14.3 as open_clip/Inf-CL do" in str(caught[0].message)


def test_scale_passed_instead_of_its_log_warns_once():
    # A fresh process, not the shared ones: the warning is a C++
    # TORCH_WARN_ONCE, shown once per process, which no reset between cases
    # brings back (any earlier case with a large scale would have used it up).
    spawn(1, _warn_worker)
