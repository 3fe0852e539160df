"""ColPali training steps with colpali-engine's late-interaction losses and with
contrax.integrations.colpali_engine's, against one process on the concatenated
global batch. Run by test_colpali_engine.py (main() on the suite's shared rank
processes), or by hand:

    torchrun --nproc_per_node W colpali_engine_steps.py

The model is a tiny ColPali stand-in (token embedding, tanh, projection, L2
normalisation, times the attention mask: padding is zero rows, as in
colpali-engine's models). Batches: queries of 5 tokens, positives of 7 and two
hard negatives of 6 per query, each with padding of its own; each rank cuts
the padding columns that none of its rows uses, so ranks hold different lengths
(an empty rank keeps every column: longer than the global batch's at some steps,
which the losses must not pad the other ranks' rows to).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("COLPALI_SCORES_BACKEND", "torch")  # the einsum reference, not an optional kernel

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from colpali_engine import loss as theirs  # noqa: E402
from torch.distributed.nn.functional import all_gather  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from contrax.integrations import colpali_engine as cx  # noqa: E402
from common import (F64, finish, init, mean_over_ranks, params_err, rel_err, report, sgd_steps, share,  # noqa: E402
                    token_column)

STEPS = 2
EXACT = 1e-10
VOCAB, LQ, LD, LN, NEGS = 40, 5, 7, 6, 2
# (name, takes negatives, constructor arguments)
LOSSES = [("ColbertLoss", False, {}), ("ColbertNegativeCELoss", True, {}),
          ("ColbertPairwiseCELoss", False, {}), ("ColbertPairwiseNegativeCELoss", True, {"temperature": 0.5}),
          ("ColbertSigmoidLoss", False, {"temperature": 0.5})]


class TinyColPali(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 12)
        self.proj = torch.nn.Linear(12, 8)

    def forward(self, input_ids, attention_mask):
        out = F.normalize(self.proj(torch.tanh(self.emb(input_ids))), dim=-1)
        return out * attention_mask.unsqueeze(-1)


def cut(col, off, count, trim=True):
    """Rows [off, off + count) (of [B, L] or [B, k, L]), without the padding columns none of them uses."""
    rows = {k: v[off:off + count] for k, v in col.items()}
    used = int(rows["attention_mask"].sum(-1).max()) if count and trim else col["input_ids"].size(-1)
    return {k: v[..., :used] for k, v in rows.items()}


def batches(rows, rank, whole=False, trim=True):
    """STEPS global batches (queries, positives, negatives [B, k, Ln]); this rank's share unless
    `whole`, padded to its longest row (to the global batch's without `trim`)."""
    out = []
    total = sum(rows)
    off, count = (0, total) if whole else share(rows, rank)
    for step in range(STEPS):
        q, d = token_column(VOCAB, total, LQ, 100 * step), token_column(VOCAB, total, LD, 100 * step + 1)
        n = token_column(VOCAB, total * NEGS, LN, 100 * step + 2)
        n = {k: v.view(total, NEGS, LN) for k, v in n.items()}
        out.append(tuple(cut(c, off, count, trim) for c in (q, d, n)))
    return out


def embed(model, item, negatives):
    q, d, n = item
    qe, de = model(**q), model(**d)
    if not negatives:
        return qe, de, None
    ne = model(n["input_ids"].flatten(0, 1), n["attention_mask"].flatten(0, 1))
    return qe, de, ne.view(*n["input_ids"].shape, ne.size(-1))  # -1 is ambiguous on an empty rank


def train(loss_fn, items, negatives, *, ddp=True, gather=None):
    """STEPS SGD steps; `gather` (the trainer's gather of the positives) returns (docs, offset)."""
    model = TinyColPali().to(F64)
    wrapped = DDP(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def loss_of(item):
        qe, de, ne = embed(wrapped, item, negatives)
        offset = 0
        if gather is not None:
            de, offset = gather(de, qe.size(0))
        args = (qe, de, ne) if negatives else (qe, de)
        return loss_fn(*args, offset=offset)

    return model, sgd_steps(opt, items, loss_of)


def trainer_gather(docs, b, contiguous=False):
    """colpali-engine's ContrastiveTrainer across processes: the positives padded to the longest
    of any rank (zeros first, as accelerate's pad_first), gathered with
    torch.distributed.nn.functional.all_gather, and offset = rank * batch_size. `contiguous`
    makes the gradient reaching the gather contiguous (see main())."""
    length = torch.tensor([docs.size(1)])
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    docs = F.pad(docs, (0, 0, int(length) - docs.size(1), 0))
    gathered = torch.cat(all_gather(docs), 0)
    if contiguous:
        gathered.register_hook(lambda grad: grad.contiguous())
    return gathered, dist.get_rank() * b


def contiguous_gather(docs, b):
    return trainer_gather(docs, b, contiguous=True)


def main():
    rank, world = init()
    even = [3] * world
    uneven = {1: [6], 2: [4, 2], 4: [3, 1, 4, 0]}[world]
    for name, negatives, args in LOSSES:
        ours, ref_cls = getattr(cx, name), getattr(theirs, name)
        for rows, what in [(even, f"{even}"), (uneven, f"uneven {uneven}")]:
            if what != f"{even}" and world == 1:
                continue
            ref = train(ref_cls(**args), batches(rows, rank, whole=True), negatives, ddp=False)
            got = train(ours(**args, gather_across_devices=True, panel_bytes=256), batches(rows, rank), negatives)
            report(rank, f"contrax {name}(gather_across_devices=True) {what}: parameters vs one process",
                   params_err(got[0], ref[0]), EXACT)
            report(rank, f"contrax {name}(gather_across_devices=True) {what}: mean loss vs one process",
                   rel_err(mean_over_ranks(got[1]), ref[1]), EXACT)
        if world == 1:
            continue
        # colpali-engine's trainer gathers the positives itself (even batches only), with its own
        # losses or Contrax's default (local) ones, which take the gathered rows and offset.
        ref = train(ref_cls(**args), batches(even, rank, whole=True, trim=False), negatives, ddp=False)
        items = batches(even, rank, trim=False)
        if name == "ColbertSigmoidLoss":
            try:
                train(ref_cls(**args), items, negatives, gather=trainer_gather)
                failed = 0.0
            except (RuntimeError, IndexError):  # its [b * b] positive mask against [b x W b] scores
                failed = 1.0
            report(rank, f"colpali-engine {name} with its trainer's gather {even}: fails", failed, 0.5, above=True)
        else:
            # On Gloo, torch.distributed.nn.functional.all_gather's backward (an all_to_all)
            # sends a non-contiguous gradient as if it were contiguous: the einsum's gradient
            # reaches it with strides (Ld, 1, Ld d), and every rank's document gradients are
            # wrong. Made contiguous, colpali-engine's loss is exact with even batches.
            mine = train(ref_cls(**args), items, negatives, gather=trainer_gather)
            report(rank, f"colpali-engine {name} with its trainer's gather on Gloo {even}: parameters vs one "
                   "process", params_err(mine[0], ref[0]), 1e-4, above=True)
            mine = train(ref_cls(**args), items, negatives, gather=contiguous_gather)
            report(rank, f"colpali-engine {name} with its trainer's gather, gradient made contiguous {even}: "
                   "parameters vs one process", params_err(mine[0], ref[0]), EXACT)
        got = train(ours(**args), items, negatives, gather=trainer_gather)
        report(rank, f"contrax {name}() with colpali-engine's trainer's gather {even}: parameters vs one process",
               params_err(got[0], ref[0]), EXACT)
    finish(rank)


if __name__ == "__main__":
    main()
