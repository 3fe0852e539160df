"""contrax.GradCache: the two-pass chunked step gives the gradients of the
ordinary one-graph step, in fp64 to 1e-10.

Single process: torch dropout replayed from the saved random state (against
the same chunks run in one graph), chunk sizes that do not divide the batch,
list/dict/custom inputs, structured outputs, tied encoders, loss scaling,
bf16 autocast. W = 1, 2, 4 Gloo processes with uneven batches (an empty rank
at W = 4): DDP encoders with a per-example deterministic dropout against one
single-process full-batch step, the loss from the binding (clip_loss, and
clip_loss tiled around the ring), gradients all-reduced exactly once per step.
Every argument error message.
"""
import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import contrax
from contrax import GradCache, GradCacheEncoder
from distributed import F64, clip_ref, nt_xent_ref, offsets, rel_err, run

TOL = 1e-10


def _grads(*modules):
    return [p.grad.clone() if p.grad is not None else None for m in modules for p in m.parameters()]


def _assert_grads_equal(got, want, tol=TOL, what="grad"):
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g is not None and w is not None, (what, k)
        assert rel_err(g, w) <= tol, (what, k, rel_err(g, w))


# ---- single process ------------------------------------------------------------

class DropoutTower(torch.nn.Module):
    """Linear - tanh - torch dropout - Linear; draws from the CPU generator."""

    def __init__(self, d_in, p=0.3):
        super().__init__()
        self.l1 = torch.nn.Linear(d_in, 8)
        self.drop = torch.nn.Dropout(p)
        self.l2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(self.drop(torch.tanh(self.l1(x))))


class KeywordTower(DropoutTower):
    """Keyword inputs, structured output: (representation, auxiliary)."""

    def forward(self, tokens, mask):  # noqa: D102 (signature on purpose: called with **chunk)
        h = self.drop(torch.tanh(self.l1(tokens * mask)))
        return self.l2(h), h.sum()


def _towers(p=0.3):
    torch.manual_seed(0)
    return DropoutTower(6, p).double(), KeywordTower(5, p).double(), torch.nn.Parameter(torch.tensor(1.3, dtype=F64))


def _data(b=10):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(b, 6, generator=g, dtype=F64)
    tokens = torch.randn(b, 5, generator=g, dtype=F64)
    mask = (torch.rand(b, 5, generator=g) > 0.2).double()
    return x, tokens, mask


def _chunked_reference(img, txt, scale, x, tokens, mask, c_img, c_txt):
    """The ordinary step, run over the same chunks in one graph, in the order
    GradCache's first pass runs them (so the dropout draws are the same)."""
    a = torch.cat([img(x[s:s + c_img]) for s in range(0, x.shape[0], c_img)])
    b = torch.cat([txt(tokens=tokens[s:s + c_txt], mask=mask[s:s + c_txt])[0]
                   for s in range(0, tokens.shape[0], c_txt)])
    loss = clip_ref(F.dropout(a, 0.2), b, scale, normalize=True)
    loss.backward()
    return loss.detach()


def _gc_dropout_step(replay_rng):
    img, txt, scale = _towers()
    x, tokens, mask = _data()
    gc = GradCache([GradCacheEncoder(img, 3), GradCacheEncoder(txt, 4, get_rep=lambda out: out[0])],
                   # The loss draws random numbers too: after the step the
                   # generator must be past those draws, not at the end of pass 2.
                   lambda a, b: contrax.clip_loss(F.dropout(a, 0.2), b, scale, normalize=True),
                   replay_rng=replay_rng)
    torch.manual_seed(123)
    loss = gc.step(x, {"tokens": tokens, "mask": mask})
    return loss, _grads(img, txt) + [scale.grad.clone()], torch.get_rng_state()


def test_rng_replay_equals_one_graph_over_the_same_chunks():
    loss, grads, rng_after = _gc_dropout_step(replay_rng=True)

    img, txt, scale = _towers()
    x, tokens, mask = _data()
    torch.manual_seed(123)
    ref_loss = _chunked_reference(img, txt, scale, x, tokens, mask, 3, 4)
    assert rel_err(loss, ref_loss) <= TOL and loss.dim() == 0 and not loss.requires_grad
    _assert_grads_equal(grads, _grads(img, txt) + [scale.grad])
    # The generator is where the one-pass step left it: later draws are unchanged.
    assert torch.equal(rng_after, torch.get_rng_state())


def test_without_rng_replay_the_gradients_differ():
    # The control for the test above: pass 2 with fresh dropout masks is
    # measurably wrong, so the comparison can fail.
    _, replayed, _ = _gc_dropout_step(replay_rng=True)
    _, fresh, _ = _gc_dropout_step(replay_rng=False)
    assert max(rel_err(f, r) for f, r in zip(fresh[:-1], replayed[:-1])) > 1e-3


def _full_batch_reference(img, txt, scale, x, tokens, mask):
    """The ordinary full-batch step (no chunks): valid without dropout."""
    loss = clip_ref(img(x), txt(tokens=tokens, mask=mask)[0], scale, normalize=True)
    loss.backward()
    return loss.detach()


def test_functional_form_dict_inputs_and_loss_scaling():
    img, txt, scale = _towers(p=0.0)
    x, tokens, mask = _data(11)
    gc = GradCache([GradCacheEncoder(img, 4, name="image"),
                    GradCacheEncoder(txt, 3, name="text", get_rep=lambda out: out[0])],
                   scale_loss=lambda loss: loss * 8)
    # Sub-batches of 5, 0 and 6 rows arrive from a data loader; encoders by
    # name and by index, in any order.
    for s, e in ((0, 5), (5, 5), (5, 11)):
        rows = gc.cache("image", x[s:e])
        assert rows.shape == (e - s, 4) and not rows.requires_grad
        gc.cache(1, {"tokens": tokens[s:e], "mask": mask[s:e]})
    assert gc.cached_rows("image") == 11 and gc.cached_rows(1) == 11
    loss = gc.finish(lambda a, b: contrax.clip_loss(a, b, scale, normalize=True))
    assert gc.cached_rows(0) == 0
    got = _grads(img, txt) + [scale.grad.clone()]

    img2, txt2, scale2 = _towers(p=0.0)
    ref_loss = _full_batch_reference(img2, txt2, scale2, x, tokens, mask)
    assert rel_err(loss, ref_loss) <= TOL  # the unscaled loss
    # Every gradient, the logit scale's included (once), carries the factor 8.
    _assert_grads_equal(got, [8 * g for g in _grads(img2, txt2) + [scale2.grad]])


def test_tied_encoders_list_inputs():
    torch.manual_seed(1)
    tower = DropoutTower(6, p=0.0).double()
    ref_tower = copy.deepcopy(tower)
    g = torch.Generator().manual_seed(3)
    v1, v2 = torch.randn(9, 6, generator=g, dtype=F64), torch.randn(9, 6, generator=g, dtype=F64)

    def pair(x, noise):  # a list input: the encoder is called as encoder(*chunk)
        return tower(x + noise)

    gc = GradCache([GradCacheEncoder(tower, 2), GradCacheEncoder(pair, 4)],
                   lambda z1, z2: contrax.nt_xent_loss(z1, z2, temperature=0.3))
    loss = gc.step(v1, [v2, 0.01 * v1])
    ref = nt_xent_ref(ref_tower(v1), ref_tower(v2 + 0.01 * v1), 0.3)
    ref.backward()
    assert rel_err(loss, ref.detach()) <= TOL
    _assert_grads_equal(_grads(tower), _grads(ref_tower))


class Batch:
    """A batch type GradCache cannot split by itself."""

    def __init__(self, rows):
        self.rows = rows  # list of [6] tensors


def test_split_function_for_custom_inputs():
    img, txt, scale = _towers(p=0.0)
    x, tokens, mask = _data(7)

    def split(batch, chunk_size):
        return [Batch(batch.rows[s:s + chunk_size]) for s in range(0, len(batch.rows), chunk_size)]

    gc = GradCache([GradCacheEncoder(lambda b: img(torch.stack(b.rows)), 3, split=split),
                    GradCacheEncoder(txt, 2, get_rep=lambda out: out[0])],
                   lambda a, b: contrax.clip_loss(a, b, scale, normalize=True))
    loss = gc.step(Batch(list(x.unbind(0))), {"tokens": tokens, "mask": mask})
    got = _grads(img, txt) + [scale.grad.clone()]
    img2, txt2, scale2 = _towers(p=0.0)
    ref_loss = _full_batch_reference(img2, txt2, scale2, x, tokens, mask)
    assert rel_err(loss, ref_loss) <= TOL
    _assert_grads_equal(got, _grads(img2, txt2) + [scale2.grad])


def test_bf16_autocast():
    torch.manual_seed(2)
    img, txt = DropoutTower(6, p=0.0), DropoutTower(5, p=0.0)
    ref_img, ref_txt = copy.deepcopy(img), copy.deepcopy(txt)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(10, 6, generator=g), torch.randn(10, 5, generator=g)
    scale = torch.tensor(1.0)

    def loss_fn(a, b):
        assert a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")  # the loss runs outside autocast
        return clip_ref(a.float(), b.float(), scale)

    gc = GradCache([GradCacheEncoder(img, 4), GradCacheEncoder(txt, 3)], loss_fn, bf16_autocast=True)
    loss = gc.step(x, y)
    assert not torch.is_autocast_enabled("cpu")

    def autocast_chunk(module, chunk):
        # One autocast region per chunk, as GradCache runs them: within one
        # region autocast caches the bf16 weight copy, and the gradients of
        # all chunks would then be summed in bf16 before reaching the fp32
        # weight, which GradCache (fp32 accumulation in .grad) does not do.
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            return module(chunk)

    a = torch.cat([autocast_chunk(ref_img, x[s:s + 4]) for s in range(0, 10, 4)])
    b = torch.cat([autocast_chunk(ref_txt, y[s:s + 3]) for s in range(0, 10, 3)])
    ref = loss_fn(a, b)
    ref.backward()
    assert loss.item() == ref.item()  # identical bf16 forwards
    # fp32 sums of per-chunk gradients, possibly in another order.
    _assert_grads_equal(_grads(img, txt), _grads(ref_img, ref_txt), tol=1e-6)


# ---- errors ----------------------------------------------------------------------

def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).double()


def test_argument_errors():
    m = _linear()
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match=r"GradCacheEncoder\(\): argument 'chunk_size' must be a positive "
                                             r"integer, but got " + re.escape(repr(bad))):
            GradCacheEncoder(m, bad)
    with pytest.raises(TypeError, match=r"GradCacheEncoder\(\): argument 'encoder' must be an nn.Module or a "
                                        r"callable, but got str"):
        GradCacheEncoder("m", 2)
    with pytest.raises(TypeError, match=r"GradCacheEncoder\(\): argument 'get_rep' must be callable or None, "
                                        r"but got int"):
        GradCacheEncoder(m, 2, get_rep=3)
    with pytest.raises(TypeError, match=r"argument 'split' must be callable or None, but got str"):
        GradCacheEncoder(m, 2, split="rows")
    with pytest.raises(ValueError, match=r"GradCacheEncoder\(\): argument 'name' must be a non-empty string or "
                                         r"None, but got ''"):
        GradCacheEncoder(m, 2, name="")
    with pytest.raises(TypeError, match=r"argument 'ddp' must be a torch.nn.parallel.DistributedDataParallel "
                                        r"or None, but got Linear"):
        GradCacheEncoder(m, 2, ddp=m)

    with pytest.raises(ValueError, match=r"GradCache\(\): argument 'encoders' is empty"):
        GradCache([])
    with pytest.raises(TypeError, match=r"GradCache\(\): argument 'encoders' must be a list or tuple of "
                                        r"GradCacheEncoder .*but got GradCacheEncoder"):
        GradCache(GradCacheEncoder(m, 2))
    with pytest.raises(ValueError, match=r"GradCache\(\): encoder 1 is a Linear, not a GradCacheEncoder; wrap it "
                                         r"in GradCacheEncoder\(encoder, chunk_size\) or pass argument "
                                         r"'chunk_size'"):
        GradCache([GradCacheEncoder(m, 2), m])
    with pytest.raises(ValueError, match=r"GradCache\(\): argument 'encoders': encoders 0 and 1 are both named "
                                         r"'t'"):
        GradCache([GradCacheEncoder(m, 2, name="t"), GradCacheEncoder(m, 2, name="t")])
    with pytest.raises(TypeError, match=r"GradCache\(\): argument 'loss_fn' must be callable or None, "
                                        r"but got float"):
        GradCache([GradCacheEncoder(m, 2)], 1.0)
    with pytest.raises(ValueError, match=r"GradCacheEncoder\(\): argument 'chunk_size' must be a positive "
                                         r"integer, but got 0"):
        GradCache([m], chunk_size=0)

    gc = GradCache([GradCacheEncoder(m, 2, name="a"), GradCacheEncoder(m, 2)], lambda a, b: (a * b).sum())
    with pytest.raises(ValueError, match=r"GradCache.cache\(\): argument 'encoder': no encoder named 'b'; the "
                                         r"named encoders are 'a'"):
        gc.cache("b", torch.zeros(2, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"GradCache.cache\(\): argument 'encoder' is 2, but there are 2 "
                                         r"encoders \(indices 0..1\)"):
        gc.cache(2, torch.zeros(2, 3, dtype=F64))
    with pytest.raises(TypeError, match=r"GradCache.cache\(\): argument 'encoder' must be an index or a name, "
                                        r"but got float"):
        gc.cache(0.0, torch.zeros(2, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"GradCache.cache\(\): argument 'inputs': input 'mask' has 3 rows but "
                                         r"input 'ids' has 4; all tensors of an input are split along dim 0 "
                                         r"together"):
        gc.cache(0, {"ids": torch.zeros(4, 3), "mask": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"GradCache.cache\(\): argument 'inputs': input 1 has 1 rows but "
                                         r"input 0 has 2"):
        gc.cache(0, [torch.zeros(2, 3), torch.zeros(1, 3)])
    with pytest.raises(ValueError, match=r"GradCache.cache\(\): argument 'inputs': the tensor is 0-dim; every "
                                         r"tensor of an input needs the batch along dim 0"):
        gc.cache(0, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"GradCache.cache\(\): argument 'inputs' holds no tensor; give the "
                                         r"encoder a split function"):
        gc.cache(0, {"flag": True})
    with pytest.raises(TypeError, match=r"GradCache.cache\(\): argument 'inputs' is a set, which cannot be split "
                                        r"along dim 0; .*split=\.\.\."):
        gc.cache(0, {1, 2})

    with pytest.raises(ValueError, match=r"GradCache.step\(\): got 1 inputs for 2 encoders"):
        gc.step(torch.zeros(2, 3, dtype=F64))
    gc.cache("a", torch.zeros(2, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"GradCache.finish\(\): encoder 1 has cached nothing; call cache\(\) "
                                         r"for every encoder before finish\(\)"):
        gc.finish()
    assert gc.cached_rows("a") == 0  # a failed finish() consumed the cache
    x = torch.randn(3, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"GradCache.finish\(\): encoder 'a' has cached nothing"):
        gc.finish()

    no_loss = GradCache([GradCacheEncoder(m, 2)])
    no_loss.cache(0, x)
    with pytest.raises(ValueError, match=r"GradCache.finish\(\): argument 'loss_fn' is required: none was given "
                                         r"here or to GradCache\(\)"):
        no_loss.finish()
    for loss_fn, msg in (
            (lambda a: a.sum(dim=1), r"argument 'loss_fn' must return a single-element tensor, but returned "
                                     r"shape \[3\]"),
            (lambda a: 1.5, r"argument 'loss_fn' must return a single-element tensor, but returned a float"),
            (lambda a: a.detach().sum(), r"the loss returned by 'loss_fn' does not depend on the representations "
                                         r"it was given \(it does not require grad\)")):
        no_loss.cache(0, x)
        with pytest.raises(ValueError, match=r"GradCache.finish\(\): " + msg):
            no_loss.finish(loss_fn)
    scaled = GradCache([GradCacheEncoder(m, 2)], lambda a: a.sum(), scale_loss=lambda loss: loss.expand(2))
    with pytest.raises(ValueError, match=r"GradCache.finish\(\): argument 'scale_loss' must return a "
                                         r"single-element tensor"):
        scaled.step(x)


def test_encoder_output_errors():
    m = _linear()
    x = torch.randn(3, 3, dtype=F64)
    with pytest.raises(TypeError, match=r"GradCache: encoder 'pair' returned a tuple, not a tensor; give "
                                        r"GradCacheEncoder a get_rep function"):
        GradCache([GradCacheEncoder(lambda t: (m(t), t), 2, name="pair")], lambda a: a.sum()).step(x)
    with pytest.raises(TypeError, match=r"GradCache: the get_rep of encoder 0 returned a list, not a tensor"):
        GradCache([GradCacheEncoder(m, 2, get_rep=lambda out: [out])], lambda a: a.sum()).step(x)
    with pytest.raises(ValueError, match=r"GradCache: the representation of encoder 0 is 0-dim; it must have "
                                         r"the batch along dim 0"):
        GradCache([GradCacheEncoder(lambda t: m(t).sum(), 2)], lambda a: a.sum()).step(x)

    calls = []

    def unstable(t):  # a different row count on its second run
        calls.append(1)
        return m(t if len(calls) <= 2 else t[:1])

    gc = GradCache([GradCacheEncoder(unstable, 2)], lambda a: a.sum())
    with pytest.raises(RuntimeError, match=r"GradCache: encoder 0 gave a representation of shape \[1, 2\] in the "
                                           r"second pass but \[2, 2\] in the first; the encoder must be "
                                           r"deterministic given its input and random state"):
        gc.step(x)
    assert gc.cached_rows(0) == 0


# ---- W = 1, 2, 4 Gloo processes, DDP ------------------------------------------------

class HashDropoutTower(torch.nn.Module):
    """Linear - tanh - dropout - Linear, with the keep mask a fixed function of
    (example id, feature): any chunking, any rank and the single-process
    reference see the same masks."""

    def __init__(self, d_in, salt, structured=False):
        super().__init__()
        self.l1 = torch.nn.Linear(d_in, 8)
        self.l2 = torch.nn.Linear(8, 4)
        self.salt = salt
        self.structured = structured

    def forward(self, x, ids):
        h = torch.tanh(self.l1(x))
        mix = (ids[:, None] * 1000003 + torch.arange(h.shape[1]) * 7919 + self.salt) % 10
        h = h * (mix >= 3).to(h.dtype) / 0.7
        out = self.l2(h)
        return {"emb": out, "hidden": h} if self.structured else out


class LogitScale(torch.nn.Module):
    """Holds the loss-side parameter so that a DDP wrapper averages its gradient."""

    def __init__(self):
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor(1.7, dtype=F64))

    def forward(self):
        return self.value


def _counting_hook(state, bucket):
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _counted_ddp(module):
    ddp = DDP(module)
    state = {"calls": 0}
    ddp.register_comm_hook(state, _counting_hook)
    return ddp, state


def _plain_step_calls():
    """All-reduce calls of one ordinary DDP forward/backward on these models:
    the count a synchronised step must match."""
    counts = []
    for module, inputs in ((HashDropoutTower(6, 0).double(), (torch.randn(3, 6, dtype=F64), torch.arange(3))),
                           (LogitScale(), ())):
        ddp, state = _counted_ddp(module)
        ddp(*inputs).sum().backward()
        counts.append(state["calls"])
    return counts


def _global_batch(step, rows):
    g = torch.Generator().manual_seed(50 + step)
    b = sum(rows)
    return (torch.randn(b, 6, generator=g, dtype=F64), torch.randn(b, 5, generator=g, dtype=F64),
            torch.arange(b) + 1000 * step)  # example ids, distinct across steps


def _two_towers():
    torch.manual_seed(0)
    return (HashDropoutTower(6, salt=1).double(), HashDropoutTower(5, salt=2, structured=True).double(),
            LogitScale())


def _ddp_two_towers(rank, world, rows, steps=2, lr=0.1):
    """Image tower (list inputs, chunks of 2), text tower (dict inputs, chunks
    of 3, structured output), logit scale in its own DDP; contrax.clip_loss."""
    tower_calls, scale_calls = _plain_step_calls()
    assert tower_calls >= 1 and scale_calls >= 1

    ref_img, ref_txt, ref_scale = _two_towers()
    ref_params = list(ref_img.parameters()) + list(ref_txt.parameters()) + list(ref_scale.parameters())
    img, txt, scale = (_counted_ddp(m) for m in _two_towers())
    gc = GradCache([GradCacheEncoder(img[0], 2, name="image"),
                    GradCacheEncoder(txt[0], 3, name="text", get_rep=lambda out: out["emb"])],
                   lambda a, b: contrax.clip_loss(a, b, scale[0](), normalize=True))
    params = [p for m in (img[0], txt[0], scale[0]) for p in m.module.parameters()]
    off, n = offsets(rows, rank)
    for step in range(steps):
        x, y, ids = _global_batch(step, rows)
        ref_loss = clip_ref(ref_img(x, ids), ref_txt(y, ids)["emb"], ref_scale(), normalize=True)
        ref_loss.backward()

        xs, ys, ids_s = x[off:off + n], y[off:off + n], ids[off:off + n]
        if step % 2 == 0:
            loss = gc.step([xs, ids_s], {"x": ys, "ids": ids_s})
        else:  # the data-loader form: two sub-batches of this rank's rows, then finish()
            for s, e in ((0, n // 2), (n // 2, n)):
                gc.cache("text", {"x": ys[s:e], "ids": ids_s[s:e]})
                gc.cache("image", [xs[s:e], ids_s[s:e]])
            loss = gc.finish()
        total = loss.clone()
        dist.all_reduce(total)
        assert rel_err(total / world, ref_loss.detach()) <= TOL, (step, total.item() / world, ref_loss.item())
        _assert_grads_equal([p.grad for p in params], [p.grad for p in ref_params], what=("step", step))
        for ddp, per_step in ((img, tower_calls), (txt, tower_calls), (scale, scale_calls)):
            assert ddp[1]["calls"] == per_step * (step + 1), ("all-reduce calls", step, ddp[1]["calls"])
        with torch.no_grad():
            for p, q in zip(params, ref_params):
                p -= lr * p.grad
                q -= lr * q.grad
                p.grad = q.grad = None


def _ddp_tied_ring(rank, world, rows, steps=2):
    """One tower DDP for both views (tied encoders, different chunk sizes),
    the loss clip_loss on the tiled path around the ring."""
    tower_calls, scale_calls = _plain_step_calls()
    torch.manual_seed(3)
    ref_tower, ref_scale = HashDropoutTower(6, salt=5).double(), LogitScale()
    (tower, tower_count), (scale, scale_count) = _counted_ddp(copy.deepcopy(ref_tower)), \
        _counted_ddp(copy.deepcopy(ref_scale))
    gc = GradCache([GradCacheEncoder(tower, 2), GradCacheEncoder(tower, 3)],
                   lambda z1, z2: contrax.clip_loss(z1, z2, scale(), normalize=True, path="tiled", tile_size=2,
                                                                    ring=True))
    off, n = offsets(rows, rank)
    for step in range(steps):
        x, _, ids = _global_batch(step, rows)
        x2 = x.flip(1) + 0.1 * x  # the second view
        ref_loss = clip_ref(ref_tower(x, ids), ref_tower(x2, ids + 500), ref_scale(), normalize=True)
        ref_loss.backward()
        loss = gc.step([x[off:off + n], ids[off:off + n]], [x2[off:off + n], ids[off:off + n] + 500])
        total = loss.clone()
        dist.all_reduce(total)
        assert rel_err(total / world, ref_loss.detach()) <= TOL
        _assert_grads_equal(_grads(tower.module, scale.module), _grads(ref_tower, ref_scale), what=("tied", step))
        assert tower_count["calls"] == tower_calls * (step + 1)  # tied: still once per step
        assert scale_count["calls"] == scale_calls * (step + 1)
        for m in (tower.module, scale.module, ref_tower, ref_scale):
            m.zero_grad(set_to_none=True)


def _no_sync_control(rank, world):
    # The control for the all-reduce count: the same step without GradCache's
    # no_sync (every chunk's backward synchronised) all-reduces once per chunk,
    # which the counting hook sees.
    torch.manual_seed(0)
    ddp, state = _counted_ddp(HashDropoutTower(6, 0).double())
    per_step = _plain_step_calls()[0]
    x, ids = torch.randn(6, 6, dtype=F64), torch.arange(6)
    gc = GradCache([GradCacheEncoder(lambda a, i: ddp(a, i), 2)], lambda a: a.square().sum())
    gc.step([x, ids])
    assert state["calls"] == 3 * per_step  # 3 chunks, not told about the DDP module
    gc = GradCache([GradCacheEncoder(lambda a, i: ddp(a, i), 2, ddp=ddp)], lambda a: a.square().sum())
    gc.step([x, ids])
    assert state["calls"] == 4 * per_step  # told: once


def _ddp_worker(rank, world, rows):
    _ddp_two_towers(rank, world, rows)
    _ddp_tied_ring(rank, world, rows)
    if world == 2:  # in this run() rather than its own: each run() makes and tears down a group
        _no_sync_control(rank, world)


@pytest.mark.parametrize("world,rows", [(1, [7]), (2, [7, 3]), (4, [5, 0, 6, 2])])
def test_ddp_grad_cache_equals_big_batch_step(world, rows):
    run(world, _ddp_worker, rows)
