"""The nn.Module forms hold their options and learnable scale, state the scale
convention (constructors take the scale, the parameter is its log), and give
the same values and gradients as the functions."""
import math

import pytest
import torch

import contrax

F64 = torch.float64


def _feats(n=6, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=F64, requires_grad=True) for _ in range(2)]


def test_clip_module_owns_log_scale_and_matches_function():
    m = contrax.ClipLoss(init_scale=1 / 0.07)
    names = dict(m.named_parameters())
    assert list(names) == ["logit_scale"]
    assert m.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert m.scale().item() == pytest.approx(1 / 0.07)
    a, b = _feats()
    loss = m(a, b)
    loss.backward()
    a2, b2 = [x.detach().clone().requires_grad_() for x in (a, b)]
    s2 = torch.tensor(math.log(1 / 0.07), dtype=F64, requires_grad=True)
    ref = contrax.clip_loss(a2, b2, s2)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(a.grad, a2.grad, rtol=1e-6, atol=1e-12)
    assert m.logit_scale.grad.item() == pytest.approx(s2.grad.item(), rel=1e-5)


def test_clip_module_fixed_scale_bias_and_tiled():
    m = contrax.ClipLoss(init_scale=20.0, learn_scale=False, init_bias=-1.5)
    assert [n for n, _ in m.named_parameters()] == ["logit_bias"]
    assert "logit_scale" in dict(m.named_buffers())
    t = contrax.ClipLoss(init_scale=20.0, learn_scale=False, init_bias=-1.5, tiled=True, tile_size=2)
    a, b = _feats(7)
    v = m(a, b)
    w = t(a.detach(), b.detach())
    assert v.item() == pytest.approx(w.item(), rel=1e-10)
    assert "bias=True" in repr(m)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_clip_module_rejects_bad_init_scale(bad):
    with pytest.raises(ValueError, match="init_scale"):
        contrax.ClipLoss(init_scale=bad)


def test_siglip_module_defaults_follow_siglip():
    m = contrax.SigLIPLoss()
    assert m.logit_scale.item() == pytest.approx(math.log(10.0))
    assert m.logit_bias.item() == -10.0
    a, b = _feats()
    v = m(a, b)
    ref = contrax.siglip_loss(a.detach(), b.detach(), m.logit_scale.detach().to(F64),
                              torch.tensor(-10.0, dtype=F64))
    assert v.item() == pytest.approx(ref.item(), rel=1e-10)
    v.backward()
    assert m.logit_scale.grad is not None and m.logit_bias.grad is not None


def test_nt_xent_and_moco_modules_match_functions():
    a, b = _feats()
    nt = contrax.NTXentLoss(temperature=0.3)
    assert nt(a, b).item() == pytest.approx(contrax.nt_xent_loss(a, b, temperature=0.3).item(), rel=1e-12)
    mo = contrax.MoCoV3Loss(temperature=0.2)
    got = mo(a, b, b.detach(), a.detach()).item()
    assert got == pytest.approx(contrax.moco_v3_loss(a, b, b.detach(), a.detach(), temperature=0.2).item(),
                                rel=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        contrax.NTXentLoss(temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        contrax.MoCoV3Loss(temperature=-1.0)


def test_grouped_module_matches_function_with_labels_and_reduction():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 5, generator=g, dtype=F64)
    c = torch.randn(12, 5, generator=g, dtype=F64)  # g = 3 candidates per query
    ids = torch.tensor([0, 1, 2, 1])
    cids = torch.tensor([0, 7, 8, 1, 9, 2, 2, 10, 11, 1, 12, 13])
    m = contrax.GroupedLoss(init_scale=1.0, reduction="none")  # logits of order 1: masking shows
    assert [n for n, _ in m.named_parameters()] == ["logit_scale"]
    rows = m(q, c, ids, cids)
    assert rows.shape == (4,)
    ref = contrax.grouped_loss(q, c, m.logit_scale.detach().to(F64), labels=ids, candidate_labels=cids,
                               reduction="none")
    assert torch.allclose(rows, ref, rtol=1e-12, atol=0)
    # Duplicate masking changes the rows whose positive's id recurs among the candidates.
    plain = contrax.grouped_loss(q, c, m.logit_scale.detach().to(F64), reduction="none")
    assert not torch.allclose(rows, plain)
    rows.sum().backward()
    assert m.logit_scale.grad is not None


def test_clip_module_labels_and_reduction():
    a, b = _feats(6)
    labels = torch.tensor([0, 1, 0, 2, 3, 1])
    m = contrax.ClipLoss(init_scale=10.0, reduction="none")
    rows = m(a, b, labels)
    assert rows.shape == (6,)
    ref = contrax.clip_loss(a.detach(), b.detach(), m.logit_scale.detach().to(F64), labels=labels,
                            reduction="none")
    assert torch.allclose(rows, ref, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="reduction"):
        contrax.ClipLoss(tiled=True, reduction="none")
    with pytest.raises(ValueError, match="labels"):
        contrax.ClipLoss(tiled=True)(a, b, labels)
