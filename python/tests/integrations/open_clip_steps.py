"""The same steps of a tiny open_clip model through open_clip's own training
loop (open_clip_train.train.train_one_epoch), with open_clip's losses and with
contrax.integrations.open_clip's, against one process on the concatenated
global batch. Run by test_open_clip.py (main() on the suite's shared rank
processes), or by hand:

    torchrun --nproc_per_node W open_clip_steps.py

Every check prints a CHECK line on rank 0 and asserts on every rank.
"""
import logging
import math
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import open_clip  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from open_clip.loss import ClipLoss as OpenClipLoss  # noqa: E402
from open_clip.loss import SigLipLoss as OpenSigLipLoss  # noqa: E402
from open_clip_train.train import train_one_epoch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import contrax.integrations.open_clip as cx  # noqa: E402
from common import F64, finish, init, mean_over_ranks, params_err, rel_err, report, share  # noqa: E402

# A CLIP small enough to run in milliseconds, built from a config dict (random
# weights, nothing downloaded).
TINY = {"embed_dim": 16,
        "vision_cfg": {"image_size": 16, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}}
STEPS = 3
EXACT = 1e-10  # fp64, relative
FP32 = 2e-5    # fp32 against open_clip's fp32 run: rounding


def new_model(siglip, dtype):
    torch.manual_seed(0)
    kw = dict(init_logit_scale=math.log(10), init_logit_bias=-10.0) if siglip else {}
    return open_clip.CLIP(**TINY, output_dict=True, **kw).to(dtype)


def batches(rows, rank, dtype, whole=False):
    """STEPS global batches of sum(rows) pairs; this rank's share unless `whole`."""
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        n = sum(rows)
        images = torch.randn(n, 3, 16, 16, generator=g, dtype=dtype)
        texts = torch.randint(0, 64, (n, 8), generator=g)
        if not whole:
            off, count = share(rows, rank)
            images, texts = images[off:off + count], texts[off:off + count]
        out.append((images, texts))
    return out


class Loader:
    """What train_one_epoch reads from data['train'].dataloader."""

    def __init__(self, items):
        self.items = items
        self.num_batches = len(items)
        self.num_samples = sum(len(b[0]) for b in items)

    def __iter__(self):
        return iter(self.items)


class DataInfo:
    def __init__(self, loader):
        self.dataloader = loader

    def set_epoch(self, epoch):
        pass


class Recorder(torch.nn.Module):
    """The loss as train_one_epoch calls it, keeping each step's value."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss
        self.values = []

    def forward(self, **kwargs):
        out = self.loss(**kwargs)
        self.values.append(out["contrastive_loss"].detach().clone())
        return out


def train(loss, items, rank, world, *, siglip=False, dtype=F64, ddp=True):
    """STEPS steps of open_clip_train's loop; returns (model, per-step loss values)."""
    model = new_model(siglip, dtype)
    wrapped = DDP(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    args = types.SimpleNamespace(
        device="cpu", precision="fp32", distill=False, accum_freq=1, skip_scheduler=True, horovod=False,
        grad_clip_norm=None, log_every_n_steps=100, rank=rank, local_rank=rank, world_size=world,
        batch_size=len(items[0][0]), wandb=False)
    rec = Recorder(loss)
    train_one_epoch(wrapped, {"train": DataInfo(Loader(items))}, rec, 0, opt, None, None, None, args)
    return model, rec.values


def reference(rows, rank, *, siglip=False, dtype=F64):
    """One process, the whole global batch, open_clip's own world-1 loss."""
    loss = OpenSigLipLoss() if siglip else OpenClipLoss()
    return train(loss, batches(rows, rank, dtype, whole=True), 0, 1, siglip=siglip, dtype=dtype, ddp=False)


def check_run(rank, name, got, ref, *, local_values, limit=EXACT):
    """Parameters equal the reference's; the values are the global loss (or
    average to it over ranks when each rank returns its share)."""
    model, values = got
    ref_model, ref_values = ref
    report(rank, f"{name}: parameters vs one process", params_err(model, ref_model), limit)
    shown = mean_over_ranks(values) if local_values else torch.stack(values)
    report(rank, f"{name}: loss values vs one process", rel_err(shown, torch.stack(ref_values)), limit)


def main():
    logging.disable(logging.INFO)  # train_one_epoch's per-step log lines
    rank, world = init()
    even = [4] * world
    uneven = {1: [6], 2: [5, 2], 4: [3, 1, 4, 2]}[world]
    w = dict(rank=rank, world_size=world)

    # ---- CLIP, fp64 -------------------------------------------------------
    ref = reference(even, rank)
    items = batches(even, rank, F64)
    runs = {}
    for local_loss in (False, True):
        for gather in (False, True):
            got = train(cx.ClipLoss(local_loss=local_loss, gather_with_grad=gather, cache_labels=True, **w),
                        items, rank, world)
            runs[local_loss, gather] = got
            check_run(rank, f"contrax ClipLoss(local_loss={local_loss}, gather_with_grad={gather})", got, ref,
                      local_values=local_loss)
    # open_clip where it is exact: the same losses, rank by rank, and parameters.
    for local_loss in (True, False):
        oc = train(OpenClipLoss(local_loss=local_loss, gather_with_grad=True, cache_labels=True, **w),
                   items, rank, world)
        cx_model, cx_values = runs[local_loss, True]
        report(rank, f"open_clip vs contrax ClipLoss(local_loss={local_loss}, gather_with_grad=True): loss "
               "values on every rank", rel_err(torch.stack(cx_values), torch.stack(oc[1])), EXACT)
        report(rank, f"open_clip vs contrax ClipLoss(local_loss={local_loss}, gather_with_grad=True): parameters",
               params_err(cx_model, oc[0]), EXACT)
    if world > 1:
        # open_clip's defaults: every gradient but the scale's is 1/W of the true one.
        oc = train(OpenClipLoss(cache_labels=True, **w), items, rank, world)
        report(rank, "open_clip ClipLoss() defaults: parameters vs one process (inexact)",
               params_err(oc[0], ref[0]), 1e-4, above=True)
        # Uneven shares (open_clip's all_gather cannot take them).
        ref_u = reference(uneven, rank)
        items_u = batches(uneven, rank, F64)
        for local_loss in (False, True):
            got = train(cx.ClipLoss(local_loss=local_loss, **w), items_u, rank, world)
            check_run(rank, f"contrax ClipLoss(local_loss={local_loss}) uneven {uneven}", got, ref_u,
                      local_values=local_loss)
        # The memory-bounded paths: tiles of 3 rows/columns, and the ring.
        got = train(cx.ClipLoss(local_loss=True, path="tiled", tile_size=3, **w), items_u, rank, world)
        check_run(rank, f"contrax ClipLoss(path='tiled', tile_size=3) uneven {uneven}", got, ref_u,
                  local_values=True)
        got = train(cx.ClipLoss(local_loss=True, ring=True, tile_size=2, **w), items, rank, world)
        check_run(rank, "contrax ClipLoss(ring=True, tile_size=2)", got, ref, local_values=True)

    # ---- SigLIP, fp64 -----------------------------------------------------
    ref_s = reference(even, rank, siglip=True)
    got = train(cx.SigLipLoss(**w), items, rank, world, siglip=True)
    check_run(rank, "contrax SigLipLoss", got, ref_s, local_values=True)
    oc = train(OpenSigLipLoss(**w), items, rank, world, siglip=True)
    report(rank, "open_clip vs contrax SigLipLoss: loss values on every rank",
           rel_err(torch.stack(got[1]), torch.stack(oc[1])), EXACT)
    report(rank, "open_clip vs contrax SigLipLoss: parameters", params_err(got[0], oc[0]), EXACT)
    if world > 1:
        ref_su = reference(uneven, rank, siglip=True)
        got = train(cx.SigLipLoss(tile_size=2, **w), batches(uneven, rank, F64), rank, world, siglip=True)
        check_run(rank, f"contrax SigLipLoss(tile_size=2) uneven {uneven}", got, ref_su, local_values=True)

    # ---- fp32: open_clip's exact modes, within rounding -------------------
    items32 = batches(even, rank, torch.float32)
    got = train(cx.ClipLoss(local_loss=True, gather_with_grad=True, **w), items32, rank, world,
                dtype=torch.float32)
    oc = train(OpenClipLoss(local_loss=True, gather_with_grad=True, **w), items32, rank, world, dtype=torch.float32)
    report(rank, "fp32 open_clip vs contrax ClipLoss(local_loss=True, gather_with_grad=True): loss values",
           rel_err(torch.stack(got[1]), torch.stack(oc[1])), FP32)
    report(rank, "fp32 open_clip vs contrax ClipLoss: parameters", params_err(got[0], oc[0]), FP32)
    got = train(cx.SigLipLoss(**w), items32, rank, world, siglip=True, dtype=torch.float32)
    oc = train(OpenSigLipLoss(**w), items32, rank, world, siglip=True, dtype=torch.float32)
    report(rank, "fp32 open_clip vs contrax SigLipLoss: loss values", rel_err(torch.stack(got[1]),
                                                                           torch.stack(oc[1])), FP32)
    report(rank, "fp32 open_clip vs contrax SigLipLoss: parameters", params_err(got[0], oc[0]), FP32)
    finish(rank)


if __name__ == "__main__":
    main()
