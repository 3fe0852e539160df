"""ColBERT training steps with PyLate's losses.Contrastive and with
contrax.integrations.pylate's, against one process on the concatenated global
batch. Run by test_pylate.py (main() on the suite's shared rank processes), or
by hand:

    torchrun --nproc_per_node W pylate_steps.py

The model is a tiny ColBERT stand-in (token embedding, tanh, projection) with
PyLate's two attributes the loss reads, ``skiplist`` and
``do_query_expansion``: the loss sees token embeddings, as from pylate's
ColBERT. Batches: queries of 5 tokens and two document columns (positive,
hard negative) of 7, each with padding of its own.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from pylate import losses as pylate_losses  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from contrax.integrations import pylate as cx  # noqa: E402
from common import (F64, finish, init, mean_over_ranks, params_err, rel_err, report, sgd_steps, share,  # noqa: E402
                    token_column)

STEPS = 2
EXACT = 1e-10
VOCAB, LQ, LD = 40, 5, 7


class TinyColBERT(torch.nn.Module):
    def __init__(self, expansion):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 12)
        self.proj = torch.nn.Linear(12, 8)
        self.skiplist = [3, 4]  # "punctuation": masked in documents
        self.do_query_expansion = expansion

    def forward(self, features):
        return {"token_embeddings": self.proj(torch.tanh(self.emb(features["input_ids"])))}


def batches(rows, rank, columns=3, whole=False):
    """STEPS global batches: queries, then the document columns; this rank's share unless `whole`."""
    out = []
    for step in range(STEPS):
        cols = [token_column(VOCAB, sum(rows), LQ if c == 0 else LD, 100 * step + c) for c in range(columns)]
        if not whole:
            off, count = share(rows, rank)
            cols = [{k: v[off:off + count] for k, v in c.items()} for c in cols]
        out.append(cols)
    return out


def train(make_loss, items, *, expansion=True, ddp=True, lr=0.5):
    """STEPS SGD steps; returns (model, per-step losses)."""
    model = TinyColBERT(expansion).to(F64)
    wrapped = DDP(model) if ddp else model
    loss_fn = make_loss(wrapped)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, sgd_steps(opt, items, loss_fn)


def main():
    rank, world = init()
    even = [3] * world
    uneven = {1: [6], 2: [4, 2], 4: [3, 1, 4, 0]}[world]
    T = 0.05
    # One process: every setting against PyLate's on the same batch.
    if rank == 0:
        for expansion in (True, False):
            for columns in (2, 3):
                for size_average in (True, False):
                    items = batches([6], 0, columns, whole=True)
                    ref = train(lambda m: pylate_losses.Contrastive(m, size_average=size_average, temperature=T),
                                items, expansion=expansion, ddp=False)
                    got = train(lambda m: cx.Contrastive(m, size_average=size_average, temperature=T), items,
                                expansion=expansion, ddp=False)
                    what = f"expansion={expansion}, {columns - 1} document column(s), size_average={size_average}"
                    report(rank, f"pylate vs contrax Contrastive ({what}): losses", rel_err(got[1], ref[1]), EXACT)
                    report(rank, f"pylate vs contrax Contrastive ({what}): parameters",
                           params_err(got[0], ref[0]), EXACT)
    # Across ranks: PyLate's own gather (even batches only) and Contrax's, even and uneven.
    ref = train(lambda m: pylate_losses.Contrastive(m, temperature=T), batches(even, rank, whole=True), ddp=False)
    got = train(lambda m: cx.Contrastive(m, gather_across_devices=True, temperature=T), batches(even, rank))
    report(rank, f"contrax Contrastive(gather_across_devices=True) {even}: parameters vs one process",
           params_err(got[0], ref[0]), EXACT)
    report(rank, f"contrax Contrastive(gather_across_devices=True) {even}: mean loss vs one process",
           rel_err(mean_over_ranks(got[1]), ref[1]), EXACT)
    # PyLate's own gather multiplies its loss by W, and its all_gather's
    # backward sums every rank's gradient into each rank's documents: under
    # DDP's averaging its loss and gradients are W times one process's (for
    # W > 1 as a learning rate W times larger).
    theirs = train(lambda m: pylate_losses.Contrastive(m, gather_across_devices=True, temperature=T),
                   batches(even, rank))
    report(rank, f"pylate Contrastive(gather_across_devices=True) {even}: first loss / W vs one process",
           rel_err(mean_over_ranks(theirs[1][:1]) / world, ref[1][:1]), EXACT)
    if world > 1:
        report(rank, f"pylate Contrastive(gather_across_devices=True) {even}: parameters vs one process",
               params_err(theirs[0], ref[0]), 1e-4, above=True)
        scaled = train(lambda m: pylate_losses.Contrastive(m, gather_across_devices=True, temperature=T),
                       batches(even, rank), lr=0.5 / world)
        report(rank, f"pylate Contrastive(gather_across_devices=True) {even} at lr / W: parameters vs one process",
               params_err(scaled[0], ref[0]), EXACT)
    if world > 1:
        ref_u = train(lambda m: pylate_losses.Contrastive(m, temperature=T), batches(uneven, rank, whole=True),
                      ddp=False)
        got_u = train(lambda m: cx.Contrastive(m, gather_across_devices=True, temperature=T, panel_bytes=256),
                      batches(uneven, rank))
        report(rank, f"contrax Contrastive(gather_across_devices=True) uneven {uneven}: parameters vs one process",
               params_err(got_u[0], ref_u[0]), EXACT)
        report(rank, f"contrax Contrastive(gather_across_devices=True) uneven {uneven}: mean loss vs one process",
               rel_err(mean_over_ranks(got_u[1]), ref_u[1]), EXACT)
    finish(rank)


if __name__ == "__main__":
    main()
