"""Gradient cache with DistributedDataParallel: a two-tower (image / text)
CLIP step over a global batch assembled from small data-loader batches.

    PYTHONPATH=build/python .venv/bin/torchrun --nproc_per_node 2 python/examples/grad_cache_ddp.py

Each rank receives its share of a step's batch as sub-batches from a loader
(uneven: the last rank's share is shorter) and hands them to GradCache.cache()
as they arrive: pass 1, no graph kept. finish() computes contrax.clip_loss on
the representations of all ranks' rows once, then re-runs every chunk with its
saved random state (the same dropout masks) and backpropagates the cached
gradients; each DDP module all-reduces once per step. The gradients are those
of one step on the whole global batch; activation memory is that of one chunk.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import contrax

CLASSES, IMG_DIM, VOCAB, TOKENS, EMB = 16, 32, 64, 6, 16


class ImageTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(IMG_DIM, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(64, EMB))

    def forward(self, pixels):
        return F.normalize(self.net(pixels), dim=1)


class TextTower(torch.nn.Module):
    """Keyword inputs and a structured output, like a Hugging Face text model."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(32, EMB))

    def forward(self, input_ids, attention_mask):
        m = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        mean = (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp(min=1)
        return {"pooled": F.normalize(self.head(mean), dim=1), "tokens": self.embed(input_ids)}


class LogitScale(torch.nn.Module):
    """The loss-side parameter, in its own DDP so that its gradient is averaged too."""

    def __init__(self):
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor(1.0 / 0.07).log())  # CLIP's init

    def forward(self):
        return self.value


def loader(step, rank, world, sub_batch=16, per_rank=64):
    """A toy paired data set: each example's class sets its image prototype and
    its caption tokens. Yields this rank's share of the step as sub-batches."""
    rows = per_rank if rank < world - 1 else per_rank - 24  # uneven: a short last share
    g = torch.Generator().manual_seed(1000 * step + rank)
    protos = torch.randn(CLASSES, IMG_DIM, generator=torch.Generator().manual_seed(0))
    for start in range(0, rows, sub_batch):
        n = min(sub_batch, rows - start)
        cls = torch.randint(CLASSES, (n,), generator=g)
        images = protos[cls] + 0.5 * torch.randn(n, IMG_DIM, generator=g)
        ids = (cls.unsqueeze(1) * 4 + torch.randint(4, (n, TOKENS), generator=g)) % VOCAB
        mask = (torch.rand(n, TOKENS, generator=g) > 0.2).long()
        yield images, {"input_ids": ids, "attention_mask": mask}


def main():
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    image, text, scale = DDP(ImageTower()), DDP(TextTower()), DDP(LogitScale())
    params = [p for m in (image, text, scale) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)

    gc = contrax.GradCache(
        [contrax.GradCacheEncoder(image, 8, name="image"),
         contrax.GradCacheEncoder(text, 8, name="text", get_rep=lambda out: out["pooled"])],
        lambda img, txt: contrax.clip_loss(img, txt, scale()))  # group: the default group

    for step in range(30):
        opt.zero_grad()
        for images, texts in loader(step, rank, world):
            gc.cache("image", images)  # pass 1 now, chunks of 8; no graph kept
            gc.cache("text", texts)    # dict input: text(**chunk)
        rows = gc.cached_rows("image")
        loss = gc.finish()             # loss once, pass 2, one all-reduce per DDP module
        opt.step()

        mean_loss = loss.clone()
        dist.all_reduce(mean_loss)     # the global mean loss: average of L_r
        batch = torch.tensor(rows)
        dist.all_reduce(batch)
        if rank == 0 and step % 10 == 9:
            print(f"step {step + 1:2d}  global batch {batch.item()}  loss {mean_loss.item() / world:.4f}  "
                  f"(chance {math.log(batch.item()):.2f})  scale {scale.module.value.exp().item():.2f}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
