"""torch.compile through Contrax: the `contrax` operators pass opcheck (schema,
fake kernels, autograd registration, AOT dispatch), a training step compiled
with fullgraph=True has no graph break (torch._dynamo.explain) and gives the
losses and gradients of eager mode, also under CPU bf16 autocast, at W = 1 and
(compile_steps.py, torchrun) W = 2 with uneven batches."""
import math

import pytest
import torch
import torch.nn.functional as F

import contrax
from contrax.integrations import lightly as cx_lightly
from contrax.integrations import open_clip as cx_open_clip
from contrax.integrations import sentence_transformers as cx_st

from launch import torchrun

F64 = torch.float64
if not hasattr(torch, "compile") or tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):
    pytest.skip(f"torch {torch.__version__} has no torch.library.register_fake/register_autograd",
                allow_module_level=True)


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def _leaf(*shape, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


# ---- the operators themselves ---------------------------------------------------------

def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))


def test_operators_pass_opcheck():
    # Slow (seconds): opcheck's test_aot_dispatch_dynamic traces every operator through AOTAutograd.
    a, b = _leaf(6, 4, seed=1), _leaf(6, 4, seed=2)
    s, bias = torch.tensor(1.2, dtype=F64, requires_grad=True), torch.tensor(-0.3, dtype=F64, requires_grad=True)
    labels = torch.tensor([0, 1, 0, 2, 3, 1])
    ops = torch.ops.contrax
    _opcheck(ops.clip_loss.default, (a, b, s, bias, True, 100.0, True, None, "multi_positive", "mean", (), (),
                                     "auto", 0, False, ""))
    _opcheck(ops.clip_loss.default, (a, b, s, None, False, 100.0, False, labels, "mask_duplicates", "none",
                                     [2, 3], [0.5, 1.0], "tiled", 2, False, ""))
    cands = _leaf(12, 4, seed=3)
    _opcheck(ops.grouped_loss.default, (a, cands, s, None, labels, torch.arange(12) % 5, "mask_duplicates",
                                        "mean", 100.0, True, (), (), "auto", 0, False, ""))
    _opcheck(ops.nt_xent_loss.default, (a, b, 0.2, True, "sum", [2], [], "materialised", 0, False, ""))
    _opcheck(ops.moco_v3_loss.default, (a, b, _leaf(6, 4, seed=4), _leaf(6, 4, seed=5), 0.2, True, "mean",
                                        (), (), "auto", 0, False, ""))
    _opcheck(ops.siglip_loss.default, (a, b, s, bias, 1e9, False, (), (), "auto", 4, False, ""))
    q_tokens, d_tokens = _leaf(6, 3, 4, seed=6), _leaf(12, 5, 4, seed=7)
    d_mask = torch.arange(5) < torch.tensor([5, 3] * 6)[:, None]
    _opcheck(ops.maxsim_loss.default, (q_tokens, d_tokens, s, None, d_mask, 1.0, 100.0, True, False, "none",
                                       0.0, 256, "auto", 0, False, ""))
    _opcheck(ops.maxsim_loss.default, (q_tokens, d_tokens, s, None, d_mask, 1.0, 100.0, True, False, "mean",
                                       0.0, 256, "tiled", 2, False, ""))
    _opcheck(ops.gather_with_grad.default, (a, "", True))
    _opcheck(ops.gather_with_grad.default, (a, "", False))
    _opcheck(ops.grad_cache_inject.default, (a, torch.randn(6, 4, dtype=F64)))


def test_operator_errors():
    a = torch.zeros(3, 2, dtype=F64)
    with pytest.raises(RuntimeError, match=r"contrax::clip_loss\(\): argument 'reduction' must be 'mean', 'sum' "
                                           r"or 'none', but got 'avg'"):
        torch.ops.contrax.clip_loss(a, a, torch.tensor(0.0, dtype=F64), None, True, 100.0, False, None,
                                    "multi_positive", "avg", (), (), "auto", 0, False, "")
    with pytest.raises(RuntimeError, match=r"contrax::nt_xent_loss\(\): argument 'group': process group 'nope' is "
                                           r"not registered with contrax"):
        torch.ops.contrax.nt_xent_loss(a, a, 0.1, True, "mean", (), (), "auto", 0, False, "nope")
    with pytest.raises(RuntimeError, match=r"contrax::grad_cache_inject\(\): argument 'grad' must have the shape "
                                           r"of 'rep' \[3, 2\], but got \[2, 3\]"):
        torch.ops.contrax.grad_cache_inject(a, torch.zeros(2, 3, dtype=F64))


# ---- a compiled training step --------------------------------------------------------

class DualEncoder(torch.nn.Module):
    """Two towers and the loss in one module: what torch.compile(model_and_loss) sees."""

    def __init__(self, loss, dtype=F64):
        super().__init__()
        torch.manual_seed(0)
        self.img = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).to(dtype)
        self.txt = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)).to(dtype)
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07), dtype=dtype))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-1.0, dtype=dtype))
        self.loss = loss

    def forward(self, x, y):
        a = F.normalize(self.img(x), dim=-1)
        b = F.normalize(self.txt(y), dim=-1)
        return self.loss(self, a, b)


def _losses():
    """Every Contrax call a training step makes, each as loss(module, a, b)."""
    oc_clip = cx_open_clip.ClipLoss()
    oc_siglip = cx_open_clip.SigLipLoss()
    nt = cx_lightly.NTXentLoss(temperature=0.3)
    mnrl = cx_st.MultipleNegativesRankingLoss(None, scale=15.0)
    return {
        "clip_loss": lambda m, a, b: contrax.clip_loss(a, b, m.logit_scale, m.logit_bias),
        "clip_loss labels": lambda m, a, b: contrax.clip_loss(
            a, b, m.logit_scale, labels=torch.arange(a.shape[0]) % 3, label_mode="mask_duplicates"),
        "clip_loss tiled": lambda m, a, b: contrax.clip_loss(a, b, m.logit_scale, path="tiled", tile_size=3),
        "siglip_loss": lambda m, a, b: contrax.siglip_loss(a, b, m.logit_scale, m.logit_bias, tile_size=3),
        "nt_xent_loss": lambda m, a, b: contrax.nt_xent_loss(a, b, temperature=0.2),
        "moco_v3_loss": lambda m, a, b: contrax.moco_v3_loss(a, b, b.detach(), a.detach(), temperature=0.2),
        "grouped_loss": lambda m, a, b: contrax.grouped_loss(a, torch.cat([b, a.flip(0)], 1).reshape(-1, 8),
                                                             m.logit_scale),
        "gather_with_grad": lambda m, a, b: F.cross_entropy(a @ contrax.gather_with_grad(b).t() * 5,
                                                            torch.arange(a.shape[0])),
        "open_clip ClipLoss": lambda m, a, b: oc_clip(a, b, m.logit_scale.exp(), m.logit_bias),
        "open_clip SigLipLoss": lambda m, a, b: oc_siglip(a, b, m.logit_scale.exp(), m.logit_bias),
        "lightly NTXentLoss": lambda m, a, b: nt(a, b),
        "sentence-transformers MNRL": lambda m, a, b: mnrl.compute_loss_from_embeddings([a, b, a.flip(0)]),
    }


def _step(module, x, y):
    for p in module.parameters():
        p.grad = None
    loss = module(x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else None for p in module.parameters()]


def _assert_grads(got, want, tol, what):
    """Equal within tol of the largest gradient entry (a gradient that is zero
    in exact arithmetic, such as CLIP's bias, holds only rounding noise)."""
    assert [g is None for g in got] == [w is None for w in want], what
    scale = max(w.abs().max().item() for w in want if w is not None)
    for g, w in zip(got, want):
        if w is not None:
            assert (g - w).abs().max().item() <= tol * scale, what


def _batch(n=7, dtype=F64):
    g = torch.Generator().manual_seed(9)
    return torch.randn(n, 12, generator=g, dtype=dtype), torch.randn(n, 10, generator=g, dtype=dtype)


@pytest.mark.parametrize("name", list(_losses()))
def test_compiled_step_has_no_graph_break_and_equals_eager(name):
    torch._dynamo.reset()
    x, y = _batch()
    eager = DualEncoder(_losses()[name])
    want_loss, want_grads = _step(eager, x, y)
    module = DualEncoder(_losses()[name])
    explained = torch._dynamo.explain(module)(x, y)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(module, fullgraph=True)
    for _ in range(2):  # the second call runs the cached graph
        loss, grads = _step(compiled, x, y)
        assert _rel(loss, want_loss) <= 1e-12, name
        _assert_grads(grads, want_grads, 1e-10, name)


def test_compiled_step_under_bf16_autocast():
    """Autocast's bf16 features reach the loss as they are; the loss
    accumulates in fp32 (its value is fp32), in eager mode and compiled alike."""
    torch._dynamo.reset()
    x, y = _batch(16, torch.float32)
    seen = {}

    def loss(m, a, b):
        seen["dtype"] = a.dtype
        return contrax.clip_loss(a, b, m.logit_scale)

    eager = DualEncoder(loss, torch.float32)
    compiled = torch.compile(DualEncoder(loss, torch.float32), fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want_grads = _step(eager, x, y)
        assert seen["dtype"] == torch.bfloat16 and want_loss.dtype == torch.float32
        got_loss, got_grads = _step(compiled, x, y)
    assert got_loss.dtype == torch.float32
    # Inductor and eager may round the bf16 towers differently: bf16's precision.
    assert _rel(got_loss, want_loss) <= 2e-2
    _assert_grads(got_grads, want_grads, 1e-1, "bf16")
    # The loss of the bf16 features is computed with fp32 accumulation: equal
    # to the fp64 loss of the same (bf16-rounded) features within fp32 rounding.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = F.normalize(eager.img(x), dim=-1)
        b = F.normalize(eager.txt(y), dim=-1)
    got = contrax.clip_loss(a, b, eager.logit_scale.detach())
    want = contrax.clip_loss(a.double(), b.double(), eager.logit_scale.detach().double())
    assert a.dtype == torch.bfloat16 and _rel(got.double(), want) <= 1e-6


def test_grad_cache_pass_two_compiles():
    """GradCache's pass 2 per chunk, encoder and injected gradient in one
    compiled graph, gives the gradients of the eager step."""
    torch._dynamo.reset()
    enc = DualEncoder(None).img
    x = _batch()[0]
    cached = torch.randn(7, 8, dtype=F64)

    def chunk(inputs, grad):
        return contrax.grad_cache_inject(enc(inputs), grad)

    explained = torch._dynamo.explain(chunk)(x, cached)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.autograd.backward(enc(x), cached)
    want = [p.grad.clone() for p in enc.parameters()]
    enc.zero_grad()
    out = torch.compile(chunk, fullgraph=True)(x, cached)
    assert out.dim() == 0 and out.item() == 0.0
    (out * 0.5).backward()
    for p, w in zip(enc.parameters(), want):
        assert _rel(p.grad, 0.5 * w) <= 1e-12


def test_grad_cache_with_compiled_encoders():
    """contrax.GradCache with torch.compile'd encoders and a compiled loss
    equals the eager GradCache step."""
    torch._dynamo.reset()
    x, y = _batch(10)
    results = []
    for compile_ in (False, True):
        m = DualEncoder(None)
        img, txt = (torch.compile(t, fullgraph=True) if compile_ else t for t in (m.img, m.txt))

        def loss_fn(a, b, m=m):
            return contrax.clip_loss(a, b, m.logit_scale, normalize=True)

        gc = contrax.GradCache([contrax.GradCacheEncoder(img, 4), contrax.GradCacheEncoder(txt, 3)],
                               torch.compile(loss_fn, fullgraph=True) if compile_ else loss_fn)
        loss = gc.step(x, y)
        results.append((loss, [p.grad.clone() for p in m.parameters() if p.grad is not None]))
    assert _rel(results[1][0], results[0][0]) <= 1e-12
    assert len(results[1][1]) == len(results[0][1]) == 9  # the towers and the scale (no bias in this loss)
    for g, w in zip(results[1][1], results[0][1]):
        assert _rel(g, w) <= 1e-10


def test_compiled_step_distributed():
    # Under torchrun, not the shared rank processes: compiling leaves process
    # state that no reset undoes (Dynamo's and Inductor's caches and config,
    # a communicator in the operators' registry), so the pool would replace
    # its processes after it anyway. Slow: a launcher, two new workers that
    # import torch, and each loss compiled on each rank.
    out = torchrun("compile_steps.py", 2)
    assert "ALL CHECKS PASSED" in out
