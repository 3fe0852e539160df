"""Writes tests/vectors/grad_cache.json: the gradient cache's test vectors,
checked by both the C++ GradCache (tests/parallel/grad_cache_vectors_test.cpp) and the
Python contrax.GradCache (python/tests/test_grad_cache_vectors.py).

The expected values come from plain PyTorch (no Contrax): the ordinary
one-graph step over the whole batch, in fp64. Two linear towers a and b
(weights given), symmetric CLIP on the L2-normalised representations with a
learnable log-scale, seven examples:
  * chunking: for each pair of chunk sizes, the rows of every encoder call of
    a step (pass 1, then pass 2, each encoder's chunks in order);
  * expected: the loss and every parameter's gradient, which any chunking
    must reproduce;
  * rng_replay: tower a followed by torch's dropout; the reference runs the
    chunks in pass 1's order in one graph after seeding the CPU generator, so
    it draws the masks pass 1 draws;
  * ddp: rows per rank (uneven, an empty rank): every rank's gradients after
    the step are `expected`, and each module's gradients are all-reduced in
    exactly one synchronised backward per step.
Run: python3 tools/gen_grad_cache_vectors.py (rewrites the file).
"""
import json
import os
import re

import torch
import torch.nn.functional as F

F64 = torch.float64
ROWS, D_IN, D_OUT = 7, 4, 3


def clip(a, b, log_scale):
    a, b = F.normalize(a, dim=1), F.normalize(b, dim=1)
    logits = a @ b.t() * log_scale.exp()
    target = torch.arange(a.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def params(g):
    def tower():
        return {"weight": torch.randn(D_OUT, D_IN, generator=g, dtype=F64),
                "bias": torch.randn(D_OUT, generator=g, dtype=F64)}
    return {"a": tower(), "b": tower(), "log_scale": torch.tensor(0.5, dtype=F64)}


def leaves(p):
    out = {f"{t}.{k}": v.clone().requires_grad_(True) for t in ("a", "b") for k, v in p[t].items()}
    out["log_scale"] = p["log_scale"].clone().requires_grad_(True)
    return out


def step(p, x, y, dropout=None, seed=None, chunk=None):
    q = leaves(p)
    if seed is not None:
        torch.manual_seed(seed)
    a_chunks = []
    for s in range(0, ROWS, chunk or ROWS):
        h = F.linear(x[s:s + (chunk or ROWS)], q["a.weight"], q["a.bias"])
        a_chunks.append(F.dropout(h, dropout) if dropout else h)
    loss = clip(torch.cat(a_chunks), F.linear(y, q["b.weight"], q["b.bias"]), q["log_scale"])
    loss.backward()
    return {"loss": loss.item(), "grads": {k: v.grad.tolist() for k, v in q.items()}}


def calls(rows, size):
    sizes = [min(size, rows - s) for s in range(0, rows, size)] or [0]
    return sizes


def main():
    g = torch.Generator().manual_seed(2026)
    p = params(g)
    x = torch.randn(ROWS, D_IN, generator=g, dtype=F64)
    y = torch.randn(ROWS, D_IN, generator=g, dtype=F64)
    chunking = []
    for ca, cb in ((2, 3), (1, 7), (7, 100), (4, 4)):
        once = {"a": calls(ROWS, ca), "b": calls(ROWS, cb)}
        chunking.append({"chunk_sizes": [ca, cb], "calls": {"a": once["a"] * 2, "b": once["b"] * 2}})
    vectors = {
        "about": "Gradient-cache test vectors (tools/gen_grad_cache_vectors.py: plain PyTorch, fp64); "
                 "checked by tests/parallel/grad_cache_vectors_test.cpp and python/tests/test_grad_cache_vectors.py",
        "towers": {t: {k: v.tolist() for k, v in p[t].items()} for t in ("a", "b")},
        "log_scale": p["log_scale"].item(),
        "inputs": {"x": x.tolist(), "y": y.tolist()},
        "loss": "symmetric CLIP on the L2-normalised representations, scale exp(log_scale)",
        "tolerance": 1e-10,
        "expected": step(p, x, y),
        "chunking": chunking,
        "rng_replay": dict(seed=123, dropout=0.5, chunk_sizes=[3, 7],
                           expected=step(p, x, y, dropout=0.5, seed=123, chunk=3)),
        "ddp": [{"rows": [4, 3], "chunk_sizes": [2, 3], "synchronised_backwards_per_step": 1},
                {"rows": [5, 0, 2], "chunk_sizes": [2, 1], "synchronised_backwards_per_step": 1}],
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "vectors", "grad_cache.json")
    text = json.dumps(vectors, indent=1)
    # One line per row of numbers.
    text = re.sub(r"\[\s*([-0-9.e+,\s]+?)\s*\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    with open(path, "w") as f:
        f.write(text + "\n")
    print("wrote", os.path.normpath(path))


if __name__ == "__main__":
    main()
