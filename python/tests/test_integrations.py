"""contrax.integrations without the peer libraries: the drop-ins' values and
gradients against their libraries' formulas written out in PyTorch (one
process, fp64), and every argument error. The runs against the real packages
are in tests/integrations/."""
import math
import types

import pytest
import torch
import torch.nn.functional as F

import contrax
from contrax.integrations import open_clip as cx_open_clip
from distributed import F64, rel_err, run


def _features(n=6, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = F.normalize(torch.randn(n, d, generator=g, dtype=F64), dim=1).requires_grad_()
    b = F.normalize(torch.randn(n, d, generator=g, dtype=F64), dim=1).requires_grad_()
    return a, b


def _grads(loss, *xs):
    return torch.autograd.grad(loss, xs, retain_graph=True)


# ---- open_clip -----------------------------------------------------------------

def _open_clip_formula(a, b, scale, bias):
    logits = scale * a @ b.t() + (0 if bias is None else bias)
    t = torch.arange(a.shape[0])
    return (F.cross_entropy(logits, t) + F.cross_entropy(logits.t(), t)) / 2


def _siglip_formula(a, b, scale, bias):
    logits = scale * a @ b.t() + bias
    z = 2 * torch.eye(a.shape[0], dtype=a.dtype) - 1
    return -F.logsigmoid(z * logits).sum() / a.shape[0]


@pytest.mark.parametrize("with_bias", [False, True])
def test_open_clip_clip_loss_takes_the_scale(with_bias):
    a, b = _features()
    log_scale = torch.tensor(math.log(1 / 0.07), dtype=F64, requires_grad=True)
    bias = torch.tensor(-0.5, dtype=F64, requires_grad=True) if with_bias else None
    scale = log_scale.exp()  # what open_clip's CLIP.forward returns
    out = cx_open_clip.ClipLoss()(a, b, scale, bias, output_dict=True)
    assert set(out) == {"contrastive_loss"}
    want = _open_clip_formula(a, b, scale, bias)
    assert rel_err(out["contrastive_loss"].detach(), want.detach()) <= 1e-13
    inputs = (a, b, log_scale) + ((bias,) if with_bias else ())
    for got, ref in zip(_grads(out["contrastive_loss"], *inputs), _grads(want, *inputs)):
        assert rel_err(got, ref) <= 1e-12 or (got - ref).abs().max() <= 1e-15


def test_open_clip_siglip_loss_takes_the_scale():
    a, b = _features()
    log_scale = torch.tensor(math.log(10.0), dtype=F64, requires_grad=True)
    bias = torch.tensor(-10.0, dtype=F64, requires_grad=True)
    got = cx_open_clip.SigLipLoss()(a, b, log_scale.exp(), bias)
    want = _siglip_formula(a, b, log_scale.exp(), bias)
    assert rel_err(got.detach(), want.detach()) <= 1e-13
    for g, r in zip(_grads(got, a, b, log_scale, bias), _grads(want, a, b, log_scale, bias)):
        assert rel_err(g, r) <= 1e-12


def test_open_clip_scale_may_be_a_number_and_large():
    a, b = _features()
    # open_clip clamps its parameter in the training loop, not in the loss:
    # a scale of 500 is used as it is (Contrax's own default clamps at 100).
    got = cx_open_clip.ClipLoss()(a, b, 500.0)
    assert rel_err(got, _open_clip_formula(a, b, 500.0, None)) <= 1e-13


def test_open_clip_create_loss_follows_args():
    args = types.SimpleNamespace(distill=False, model="ViT-B-32", siglip=False, local_loss=True,
                                 gather_with_grad=True, rank=0, world_size=1, horovod=False, loss_dist_impl=None)
    loss = cx_open_clip.create_loss(args)
    assert isinstance(loss, cx_open_clip.ClipLoss) and loss.local_loss and loss.gather_with_grad
    args.siglip, args.loss_dist_impl = True, "shift"
    loss = cx_open_clip.create_loss(args)
    assert isinstance(loss, cx_open_clip.SigLipLoss) and loss.dist_impl == "shift"
    with pytest.raises(ValueError, match=r"create_loss\(\): args.model is 'coca_ViT-B-32', a CoCa model"):
        cx_open_clip.create_loss(types.SimpleNamespace(**{**vars(args), "model": "coca_ViT-B-32"}))
    with pytest.raises(ValueError, match=r"create_loss\(\): args.distill is set"):
        cx_open_clip.create_loss(types.SimpleNamespace(**{**vars(args), "distill": True}))


def test_open_clip_argument_errors():
    a, b = _features()
    with pytest.raises(ValueError, match=r"ClipLoss\(\): argument 'use_horovod' must be False"):
        cx_open_clip.ClipLoss(use_horovod=True)
    with pytest.raises(ValueError, match=r"SigLipLoss\(\): argument 'dist_impl' must be 'bidir', 'shift', "
                                         r"'reduce', 'gather' or None, but got 'ring'"):
        cx_open_clip.SigLipLoss(dist_impl="ring")
    with pytest.raises(ValueError, match=r"ClipLoss.forward\(\): argument 'world_size' is 2, but "
                                         r"torch.distributed is not initialised"):
        cx_open_clip.ClipLoss(rank=1, world_size=2)(a, b, 10.0)
    with pytest.raises(ValueError, match=r"ClipLoss.forward\(\): argument 'logit_scale' must be a scalar "
                                         r"\(0-dim\) tensor, but got shape \[3\]"):
        cx_open_clip.ClipLoss()(a, b, torch.ones(3, dtype=F64))
    with pytest.raises(TypeError, match=r"SigLipLoss.forward\(\): argument 'logit_bias' must be a tensor or a "
                                        r"number, but got str"):
        cx_open_clip.SigLipLoss()(a, b, 10.0, "x")


def _rank_mismatch_worker(rank, world):
    a, b = _features(seed=rank)
    with pytest.raises(ValueError, match=r"ClipLoss.forward\(\): arguments 'rank'=0 and 'world_size'=3 do not "
                                         rf"match the process group \(rank {rank} of 2\)"):
        cx_open_clip.ClipLoss(rank=0, world_size=3)(a, b, 10.0)
    if rank == 1:
        with pytest.raises(ValueError, match=r"SigLipLoss.forward\(\): arguments 'rank'=0 and 'world_size'=2 do "
                                             r"not match the process group \(rank 1 of 2\)"):
            cx_open_clip.SigLipLoss(rank=0, world_size=2)(a, b, 10.0, -10.0)
    # world_size=1 under an initialised group is open_clip's one-process loss: this rank's rows alone.
    got = cx_open_clip.ClipLoss()(a, b, 10.0)
    assert rel_err(got, _open_clip_formula(a, b, 10.0, None)) <= 1e-13
    assert rel_err(contrax.clip_loss(a, b, torch.tensor(math.log(10.0), dtype=F64), max_logit_scale=1e9,
                                     group=contrax.LOCAL), got) <= 1e-13


def test_open_clip_rank_and_world_size_are_checked():
    run(2, _rank_mismatch_worker)


# ---- lightly -------------------------------------------------------------------

def _lightly_formula(out0, out1, temperature):
    """lightly's NTXentLoss without memory bank, one process (lightly/loss/ntx_ent_loss.py)."""
    z0, z1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
    n = z0.shape[0]
    keep = ~torch.eye(n, dtype=torch.bool)
    l00 = (z0 @ z0.t() / temperature)[keep].view(n, -1)
    l11 = (z1 @ z1.t() / temperature)[keep].view(n, -1)
    logits = torch.cat([torch.cat([z0 @ z1.t() / temperature, l00], 1),
                        torch.cat([z1 @ z0.t() / temperature, l11], 1)])
    return F.cross_entropy(logits, torch.arange(n).repeat(2))


def test_lightly_nt_xent_matches_its_formula():
    from contrax.integrations import lightly as cx_lightly
    g = torch.Generator().manual_seed(3)
    out0 = torch.randn(7, 4, generator=g, dtype=F64, requires_grad=True)
    out1 = torch.randn(7, 4, generator=g, dtype=F64, requires_grad=True)
    got = cx_lightly.NTXentLoss(temperature=0.2)(out0, out1)
    want = _lightly_formula(out0, out1, 0.2)
    assert rel_err(got.detach(), want.detach()) <= 1e-13
    for a, b in zip(_grads(got, out0, out1), _grads(want, out0, out1)):
        assert rel_err(a, b) <= 1e-12


def test_lightly_argument_errors():
    from contrax.integrations import lightly as cx_lightly
    with pytest.raises(ValueError, match=r"NTXentLoss\(\): argument 'temperature' must be a finite number > 0, "
                                         r"but got -0.5"):
        cx_lightly.NTXentLoss(temperature=-0.5)
    with pytest.raises(ValueError, match=r"NTXentLoss\(\): argument 'memory_bank_size' must be 0, but got "
                                         r"\(4096, 128\): the memory bank \(MoCo v2\) is lightly's own"):
        cx_lightly.NTXentLoss(memory_bank_size=(4096, 128))
    assert cx_lightly.NTXentLoss(memory_bank_size=(0, 128)).memory_bank_size == (0, 128)


# ---- sentence-transformers -------------------------------------------------------

def _mnrl_formula(columns, scale, cosine, same_text):
    """sentence-transformers' MNRL written out, one process: anchor i against
    every positive and hard negative, target its own positive; candidates that
    `same_text(i, column, j)` says carry anchor i's positive's text (other than
    that positive) left out."""
    q, docs = columns[0], columns[1:]
    if cosine:
        q, docs = F.normalize(q, dim=1), [F.normalize(d, dim=1) for d in docs]
    n = q.shape[0]
    logits = scale * q @ torch.cat(docs).t()  # [n, n * len(docs)], column-major
    for i in range(n):
        for c in range(len(docs)):
            for j in range(n):
                if (c, j) != (0, i) and same_text(i, c, j):
                    logits[i, c * n + j] = float("-inf")
    return F.cross_entropy(logits, torch.arange(n))


def _tokens(texts, width):
    """A tokenised column: one id per word, right-padded with 0 to `width`."""
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for r, t in enumerate(texts):
        toks = [sum(map(ord, w)) for w in t.split()]
        ids[r, :len(toks)] = torch.tensor(toks)
        mask[r, :len(toks)] = 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("cosine", [True, False])
def test_sentence_transformers_mnrl_matches_its_formula(cosine):
    from contrax.integrations import sentence_transformers as cx_st
    g = torch.Generator().manual_seed(5)
    cols = [torch.randn(5, 4, generator=g, dtype=F64, requires_grad=True) for _ in range(3)]
    sim = cx_st._cos_sim if cosine else types.SimpleNamespace(__name__="dot_score")
    loss = cx_st.MultipleNegativesRankingLoss(None, scale=7.0, similarity_fct=sim)
    got = loss.compute_loss_from_embeddings(cols)
    want = _mnrl_formula(cols, 7.0, cosine, lambda i, c, j: False)
    assert rel_err(got.detach(), want.detach()) <= 1e-13
    for a, b in zip(_grads(got, *cols), _grads(want, *cols)):
        assert rel_err(a, b) <= 1e-12


def test_sentence_transformers_duplicates_of_the_positive_are_masked():
    from contrax.integrations import sentence_transformers as cx_st
    positives = ["red apple", "green pear", "red apple", "blue sky"]    # anchors 0 and 2 share a positive
    negatives = ["blue sky", "dark night", "wet rain", "green pear"]   # and two negatives repeat positives
    pos_cols, neg_cols = _tokens(positives, 4), _tokens(negatives, 6)  # another width: ids ignore padding
    ids = [cx_st.text_ids(_tokens(["q a", "q b", "q c", "q d"], 3)), cx_st.text_ids(pos_cols),
           cx_st.text_ids(neg_cols)]
    assert ids[1][0] == ids[1][2] and ids[1][3] == ids[2][0] and ids[1][1] == ids[2][3] and ids[1][0] != ids[1][1]
    g = torch.Generator().manual_seed(6)
    cols = [torch.randn(4, 3, generator=g, dtype=F64, requires_grad=True) for _ in range(3)]
    texts = [positives, negatives]
    # Slow where it is the first (seconds): the default similarity is
    # sentence-transformers' own cos_sim where installed, whose import loads transformers.
    loss = cx_st.MultipleNegativesRankingLoss(None)
    got = loss.compute_loss_from_embeddings(cols, ids=ids)
    want = _mnrl_formula(cols, 20.0, True, lambda i, c, j: texts[c][j] == positives[i])
    assert rel_err(got.detach(), want.detach()) <= 1e-13
    for a, b in zip(_grads(got, *cols), _grads(want, *cols)):
        assert rel_err(a, b) <= 1e-12
    # Without the masking, the duplicates are negatives (sentence-transformers' own loss).
    plain = cx_st.MultipleNegativesRankingLoss(None, mask_duplicates=False)
    assert plain._ids([pos_cols, neg_cols]) is None
    unmasked = _mnrl_formula(cols, 20.0, True, lambda i, c, j: False)
    assert rel_err(plain.compute_loss_from_embeddings(cols), unmasked) <= 1e-13
    assert rel_err(unmasked, want) > 1e-3


class _TinyEncoder(torch.nn.Module):
    """What a SentenceTransformer looks like to its losses: features in, a dict
    with `sentence_embedding` out (and written into the features, as its
    modules do)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(500, 6).double()
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, features):
        m = features["attention_mask"].unsqueeze(-1).double()
        features["sentence_embedding"] = self.drop((self.embed(features["input_ids"] % 500) * m).sum(1) / m.sum(1))
        return features


def test_sentence_transformers_cached_equals_uncached():
    from contrax.integrations import sentence_transformers as cx_st
    cols = [_tokens([f"q{i} w{i % 3}" for i in range(7)], 3), _tokens([f"p{i} x y{i}" for i in range(7)], 4),
            _tokens([f"n{i}" for i in range(7)], 2)]
    grads = []
    for make in (lambda m: cx_st.MultipleNegativesRankingLoss(m, scale=9.0),
                 lambda m: cx_st.CachedMultipleNegativesRankingLoss(m, scale=9.0, mini_batch_size=3)):
        model = _TinyEncoder().eval()  # no dropout: the uncached loss runs the columns in other batches
        loss = make(model)(cols, None)
        (loss * 0.25).backward()  # a gradient-accumulation scale must reach the re-embedded mini-batches
        grads.append((loss.detach(), model.embed.weight.grad.clone()))
    assert rel_err(grads[1][0], grads[0][0]) <= 1e-13
    assert rel_err(grads[1][1], grads[0][1]) <= 1e-12
    with torch.no_grad():  # evaluation: the loss alone
        model = _TinyEncoder().eval()
        value = cx_st.CachedMultipleNegativesRankingLoss(model, scale=9.0, mini_batch_size=2)(cols, None)
    assert rel_err(value, grads[0][0]) <= 1e-13


@pytest.mark.parametrize("prefixes", [([2, 6, 3], [0.5, 1.5, 2.0]), ([3, 2, 3], [1.0, 0.25, 0.5])],
                         ids=["with_full_width", "without_it_3_twice"])
@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cmnrl"])
def test_sentence_transformers_matryoshka_matches_its_formula(cached, prefixes):
    # sum_p w_p MNRL(each column's first m_p columns, normalised); the full
    # width (6) counts only where listed, a width listed twice counts twice.
    # The package's own MatryoshkaLoss is compared in
    # integrations/test_sentence_transformers.py.
    from contrax.integrations import sentence_transformers as cx_st
    cols = [_tokens([f"q{i} w{i % 3}" for i in range(7)], 3), _tokens([f"p{i} x y{i}" for i in range(7)], 4),
            _tokens([f"n{i}" for i in range(7)], 2)]
    dims, weights = prefixes
    sim = types.SimpleNamespace(__name__="dot_score")  # every prefix is normalised whatever the similarity
    model = _TinyEncoder().eval()
    emb = [model(dict(c))["sentence_embedding"] for c in cols]
    want = sum(w * _mnrl_formula([e[:, :m] for e in emb], 9.0, True, lambda i, c, j: False)
               for m, w in zip(dims, weights))
    want_grad, = torch.autograd.grad(want, model.embed.weight)
    inner = (cx_st.CachedMultipleNegativesRankingLoss(model, scale=9.0, similarity_fct=sim, mini_batch_size=3)
             if cached else cx_st.MultipleNegativesRankingLoss(model, scale=9.0, similarity_fct=sim))
    got = cx_st.MatryoshkaLoss(model, inner, dims, weights)(cols, None)
    got.backward()
    assert rel_err(got.detach(), want.detach()) <= 1e-13
    assert rel_err(model.embed.weight.grad, want_grad) <= 1e-12
    # A model that does not say its width: the widths are checked at the call.
    with pytest.raises(ValueError, match=r"forward\(\): MatryoshkaLoss's 'matryoshka_dims' must hold widths in "
                                         r"\[1, 6\] \(the embeddings' width\), but got 8"):
        cx_st.MatryoshkaLoss(model, inner, [8, 3])(cols, None)


def test_sentence_transformers_argument_errors():
    from contrax.integrations import sentence_transformers as cx_st
    M, C = cx_st.MultipleNegativesRankingLoss, cx_st.CachedMultipleNegativesRankingLoss
    with pytest.raises(ValueError, match=r"MultipleNegativesRankingLoss\(\): argument 'directions' must be "
                                         r"\('query_to_doc',\), but got \('query_to_doc', 'doc_to_query'\)"):
        M(None, directions=("query_to_doc", "doc_to_query"))
    with pytest.raises(ValueError, match=r"MultipleNegativesRankingLoss\(\): argument 'hardness_mode' must be "
                                         r"None \(or 'hardness_strength' 0\), but got 'hard_negatives' with"):
        M(None, hardness_mode="hard_negatives", hardness_strength=5.0)
    with pytest.raises(ValueError, match=r"MultipleNegativesRankingLoss\(\): argument 'scale' must be a positive "
                                         r"number, but got 0"):
        M(None, scale=0)
    with pytest.raises(ValueError, match=r"argument 'partition_mode' must be 'joint' or 'per_direction'"):
        M(None, partition_mode="rows")
    with pytest.raises(ValueError, match=r"MultipleNegativesRankingLoss\(\): argument 'similarity_fct' must be "
                                         r"sentence_transformers.util.cos_sim or dot_score .*but got euclidean_sim"):
        M(None, similarity_fct=types.SimpleNamespace(__name__="euclidean_sim"))
    with pytest.raises(ValueError, match=r"CachedMultipleNegativesRankingLoss\(\): argument 'mini_batch_size' "
                                         r"must be a positive integer, but got 0"):
        C(None, mini_batch_size=0)
    with pytest.raises(ValueError, match=r"CachedMultipleNegativesRankingLoss\(\): argument "
                                         r"'mini_batch_num_tokens' must be None"):
        C(None, mini_batch_num_tokens=512)
    with pytest.raises(ValueError, match=r"MultipleNegativesRankingLoss.forward\(\): expected at least 2 columns "
                                         r"\(anchor, positive, ...\), got 1"):
        M(None).compute_loss_from_embeddings([torch.zeros(2, 3, dtype=F64)])
    with pytest.raises(ValueError, match=r"CachedMultipleNegativesRankingLoss.forward\(\): expected at least 2 "
                                         r"columns"):
        C(_TinyEncoder())([_tokens(["a"], 1)], None)
