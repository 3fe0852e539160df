"""contrax.integrations.colpali_engine against colpali-engine's own late-interaction
losses: loss and gradients in one process on zero-padded token embeddings (the
inputs its models make, and its own tests' examples), ColPali steps at W = 1, 2,
4 Gloo ranks (colpali_engine_steps.py has the checks; `torchrun
--nproc_per_node W colpali_engine_steps.py` runs them by hand), and the
refusals. colpali-engine 0.3.18 pins torch < 2.14: tools/setup.sh installs it
without its dependencies (requirements/test-no-deps.txt); its losses need none
beyond ours."""
import os

import pytest

os.environ.setdefault("COLPALI_SCORES_BACKEND", "torch")  # the einsum reference, not an optional kernel
pytest.importorskip("colpali_engine", reason="colpali-engine is not installed (requirements/test-no-deps.txt)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from colpali_engine import loss as theirs  # noqa: E402

from contrax.integrations import colpali_engine as cx  # noqa: E402
from launch import ranks  # noqa: E402

EXACT = 1e-10
WITH_NEGATIVES = {"ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss"}
NAMES = ["ColbertLoss", "ColbertNegativeCELoss", "ColbertPairwiseCELoss", "ColbertPairwiseNegativeCELoss",
         "ColbertSigmoidLoss"]


def padded(*shape, seed):
    """Unit token rows [..., L, d], zero beyond each row's random length; (leaf, valid rows)."""
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)
    length = shape[-2]
    valid = torch.arange(length) < torch.randint(2, length + 1, shape[:-2], generator=g)[..., None]
    return (x * valid[..., None]).requires_grad_(), valid


def loss_and_grads(loss, inputs, offset):
    for x in inputs:
        x.grad = None
    value = loss(*inputs, offset=offset)
    value.backward()
    return value.detach(), [x.grad.clone() for x in inputs]


def compare(name, args, inputs, valid, offset=0):
    """colpali-engine's loss and Contrax's on the same inputs; the gradients on the valid rows
    (colpali-engine's amax splits a tie between zero rows, Contrax's MaxSim gives it to the first:
    no model sees a difference, since its padding rows are multiplied by 0)."""
    want, want_grads = loss_and_grads(getattr(theirs, name)(**args), inputs, offset)
    got, got_grads = loss_and_grads(getattr(cx, name)(**args), inputs, offset)
    assert abs(got - want).item() <= EXACT * abs(want).item(), (name, args, got, want)
    for g, w, v in zip(got_grads, want_grads, valid):
        scale = w.abs().max().item()
        assert ((g - w) * v[..., None]).abs().max().item() <= EXACT * scale, (name, args)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("normalize", [True, False])
def test_one_process_matches(name, normalize):
    b = 4
    q, qv = padded(b, 5, 8, seed=1)
    d, dv = padded(3 * b, 7, 8, seed=2)  # the positives of 3 ranks, as colpali-engine's trainer gathers them
    n, nv = padded(b, 2, 6, 8, seed=3)
    temperatures = [1.0, 0.02] if "Pairwise" in name else [0.02, 0.5]
    for temperature in temperatures:
        for weight in ([0.0, 0.5, 1.0] if name in WITH_NEGATIVES else [None]):
            args = dict(temperature=temperature, normalize_scores=normalize)
            if weight is not None:
                args["in_batch_term_weight"] = weight
            negatives = ([n], [nv]) if name in WITH_NEGATIVES else ([], [])
            own = d[:b].detach().clone().requires_grad_()
            compare(name, args, [q, own] + negatives[0], [qv, dv[:b]] + negatives[1])
            if name != "ColbertSigmoidLoss":  # colpali-engine's takes as many documents as queries
                compare(name, args, [q, d] + negatives[0], [qv, dv] + negatives[1], offset=b)


def test_colpali_engines_own_examples():
    """The zero embeddings of colpali-engine's tests (tests/loss/test_li_losses.py): log B for
    the InfoNCE, softplus(0) for the pairwise losses."""
    B, Nq, D = 3, 1, 4
    zeros = torch.zeros(B, Nq, D, dtype=torch.float64)
    plain = dict(temperature=1.0, normalize_scores=False)
    assert torch.allclose(cx.ColbertLoss(**plain)(zeros, zeros), torch.log(torch.tensor(3.0, dtype=torch.float64)))
    for name in ["ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss"]:
        for weight in (0.0, 0.5):
            neg = torch.zeros(B, 1, Nq, D, dtype=torch.float64)
            args = dict(plain, in_batch_term_weight=weight)
            want = getattr(theirs, name)(**args)(zeros, zeros, neg)
            assert torch.allclose(getattr(cx, name)(**args)(zeros, zeros, neg), want), name
    want = theirs.ColbertPairwiseCELoss(**plain)(zeros, zeros)
    assert torch.allclose(cx.ColbertPairwiseCELoss(**plain)(zeros, zeros), want)
    assert torch.allclose(want, F.softplus(torch.tensor(0.0, dtype=torch.float64)))


def test_colpali_engines_sigmoid_loss_fails_on_gathered_documents():
    """colpali-engine's ColbertSigmoidLoss builds a [b * b] positive mask: with more documents
    than queries (its trainer's gathered ones under DDP) it fails; Contrax's scores them."""
    q, _ = padded(2, 5, 8, seed=1)
    d, _ = padded(6, 7, 8, seed=2)
    with pytest.raises((RuntimeError, IndexError)):
        theirs.ColbertSigmoidLoss()(q, d, offset=2)
    got = cx.ColbertSigmoidLoss()(q, d, offset=2)
    scores = torch.einsum("bnd,msd->bmns", q, d).amax(-1).sum(-1) / (q[:, :, 0] != 0).sum(1)[:, None]
    sign = -torch.ones(2, 6, dtype=torch.float64)
    sign[0, 2] = sign[1, 3] = 1
    assert torch.allclose(got, F.softplus(-sign * scores / 0.02).mean())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_colpali_engine_steps_match(world):
    ranks("colpali_engine_steps", world)


def test_refusals():
    for name in NAMES:
        with pytest.raises(ValueError, match=rf"{name}\(\): argument 'use_smooth_max' must be False: Contrax's MaxSim "
                                             r"takes the hard maximum over a document's tokens"):
            getattr(cx, name)(use_smooth_max=True)
        with pytest.raises(ValueError, match=rf"{name}\(\): argument 'pos_aware_negative_filtering' must be False: "
                                             r"it scales the in-batch negatives scoring above filter_threshold"):
            getattr(cx, name)(pos_aware_negative_filtering=True)
        with pytest.raises(ValueError, match=rf"{name}\(\): argument 'temperature' must be > 0, but got 0"):
            getattr(cx, name)(temperature=0)
    for name in WITH_NEGATIVES:
        with pytest.raises(ValueError, match=rf"{name}\(\): argument 'in_batch_term_weight' must be in \[0, 1\], "
                                             r"but got 1.5"):
            getattr(cx, name)(in_batch_term_weight=1.5)
    q, d = torch.ones(2, 3, 4), torch.ones(4, 5, 4)
    with pytest.raises(ValueError, match=r"ColbertLoss.forward\(\): argument 'offset' must be 0 and 'doc_embeddings' "
                                         r"this rank's 2 positives with gather_across_devices=True \(Contrax gathers "
                                         r"every rank's documents itself\), but got offset 2 and 4 documents"):
        cx.ColbertLoss(gather_across_devices=True)(q, d, offset=2)
    with pytest.raises(ValueError, match=r"ColbertLoss.forward\(\): argument 'offset' must leave the 2 queries' "
                                         r"positives inside 'doc_embeddings' \(4 rows\), but got 3"):
        cx.ColbertLoss()(q, d, offset=3)
    with pytest.raises(ValueError, match=r"ColbertLoss.forward\(\): argument 'doc_embeddings' must hold a multiple "
                                         r"of the 2 queries' rows \(Contrax groups the candidates per query\), but "
                                         r"got 3"):
        cx.ColbertLoss()(q, d[:3], offset=1)
    with pytest.raises(ValueError, match=r"ColbertLoss.forward\(\): arguments 'query_embeddings' and "
                                         r"'doc_embeddings' must be 3-D \[rows, tokens, dim\], but got \[2, 3, 4\] "
                                         r"and \[4, 4\]"):
        cx.ColbertLoss()(q, d[:, 0])
    with pytest.raises(ValueError, match=r"ColbertNegativeCELoss.forward\(\): argument 'neg_doc_embeddings' must be "
                                         r"\[2, negatives, tokens, dim\] \(its query's negatives per row\), but got "
                                         r"\[2, 5, 4\]"):
        cx.ColbertNegativeCELoss()(q, d[:2], d[:2])
