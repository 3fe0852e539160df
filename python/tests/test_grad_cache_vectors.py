"""contrax.GradCache against the gradient cache's shared test vectors
(tests/vectors/grad_cache.json, written by tools/gen_grad_cache_vectors.py
from plain PyTorch), the same file tests/parallel/grad_cache_vectors_test.cpp checks
the C++ GradCache against: the rows of every encoder call for each chunking,
the loss and gradients any chunking must give, torch's dropout replayed from
the saved random state, and on Gloo ranks with uneven rows and an empty one,
the same gradients with each DDP module all-reduced in one synchronised
backward per step.
"""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import contrax
from contrax import GradCache, GradCacheEncoder
from distributed import F64, offsets, rel_err, run

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "vectors", "grad_cache.json")
with open(_PATH) as _f:
    V = json.load(_f)
TOL = V["tolerance"]


class LogScale(torch.nn.Module):
    """The loss's learnable log-scale, as a module (so that DDP averages it)."""

    def __init__(self, value):
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor(value, dtype=F64))

    def forward(self):
        return self.value


def _model():
    towers = {}
    for name in ("a", "b"):
        w = torch.tensor(V["towers"][name]["weight"], dtype=F64)
        t = torch.nn.Linear(w.shape[1], w.shape[0]).double()
        with torch.no_grad():
            t.weight.copy_(w)
            t.bias.copy_(torch.tensor(V["towers"][name]["bias"], dtype=F64))
        towers[name] = t
    return towers["a"], towers["b"], LogScale(V["log_scale"])


def _inputs():
    return torch.tensor(V["inputs"]["x"], dtype=F64), torch.tensor(V["inputs"]["y"], dtype=F64)


def _assert_expected(a, b, scale, expected, what):
    got = {"a.weight": a.weight.grad, "a.bias": a.bias.grad, "b.weight": b.weight.grad, "b.bias": b.bias.grad,
           "log_scale": scale.value.grad}
    assert set(got) == set(expected["grads"]), what
    for name, g in got.items():
        assert g is not None, (what, name)
        assert rel_err(g, torch.tensor(expected["grads"][name], dtype=F64)) <= TOL, (what, name)


def _loss(scale):
    return lambda ra, rb: contrax.clip_loss(ra, rb, scale(), normalize=True)


@pytest.mark.parametrize("case", V["chunking"], ids=lambda c: "chunks_%d_%d" % tuple(c["chunk_sizes"]))
def test_every_chunking_calls_the_encoders_on_the_rows_and_gives_the_gradients(case):
    a, b, scale = _model()
    calls = {"a": [], "b": []}

    def encoder(name, tower):
        def run_tower(x):
            calls[name].append(x.shape[0])
            return tower(x)
        return run_tower

    ca, cb = case["chunk_sizes"]
    gc = GradCache([GradCacheEncoder(encoder("a", a), ca), GradCacheEncoder(encoder("b", b), cb)], _loss(scale))
    loss = gc.step(*_inputs())
    assert calls == case["calls"]
    assert abs(loss.item() - V["expected"]["loss"]) <= 1e-12
    _assert_expected(a, b, scale, V["expected"], case["chunk_sizes"])


def test_dropout_is_replayed_from_the_saved_random_state():
    r = V["rng_replay"]
    a, b, scale = _model()
    ca, cb = r["chunk_sizes"]
    gc = GradCache([GradCacheEncoder(lambda x: F.dropout(a(x), r["dropout"]), ca), GradCacheEncoder(b, cb)],
                   _loss(scale))
    torch.manual_seed(r["seed"])
    loss = gc.step(*_inputs())
    assert abs(loss.item() - r["expected"]["loss"]) <= 1e-12
    _assert_expected(a, b, scale, r["expected"], "rng replay")


def _counting_hook(state, bucket):
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _ddp_worker(rank, world, case):
    a, b, scale = _model()
    ddps, counts = [], []
    for m in (a, b, scale):
        ddp = DDP(m)  # one bucket each (the default 25 MB)
        state = {"calls": 0}
        ddp.register_comm_hook(state, _counting_hook)
        ddps.append(ddp)
        counts.append(state)
    ca, cb = case["chunk_sizes"]
    gc = GradCache([GradCacheEncoder(ddps[0], ca), GradCacheEncoder(ddps[1], cb)], _loss(ddps[2]))
    off, n = offsets(case["rows"], rank)
    x, y = _inputs()
    gc.step(x[off:off + n], y[off:off + n])
    _assert_expected(a, b, scale, V["expected"], ("rank", rank, case["rows"]))
    for state in counts:
        assert state["calls"] == case["synchronised_backwards_per_step"], (rank, state)


@pytest.mark.parametrize("case", V["ddp"], ids=lambda c: "rows_" + "_".join(map(str, c["rows"])))
def test_ddp_ranks_get_the_gradients_with_one_synchronisation_per_step(case):
    run(len(case["rows"]), _ddp_worker, case)
