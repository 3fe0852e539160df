"""CLIP-style training with DistributedDataParallel and contrax's exact loss.

    PYTHONPATH=build/python .venv/bin/torchrun --nproc_per_node 2 python/examples/ddp_clip.py

Every rank holds its own share of the batch (here uneven: the last rank gets a
short batch); contrax.clip_loss computes [local x global] logits against the
rows of all ranks, and DDP's gradient averaging turns the per-rank losses into
exactly the gradient of the mean loss over the global batch.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import contrax


class DualEncoder(torch.nn.Module):
    def __init__(self, img_dim=32, txt_dim=24, emb=16):
        super().__init__()
        self.img = torch.nn.Sequential(torch.nn.Linear(img_dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, emb))
        self.txt = torch.nn.Sequential(torch.nn.Linear(txt_dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, emb))
        self.logit_scale = torch.nn.Parameter(torch.tensor(1.0 / 0.07).log())  # CLIP's init

    def forward(self, images, texts):
        return F.normalize(self.img(images), dim=1), F.normalize(self.txt(texts), dim=1), self.logit_scale


def main():
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(DualEncoder())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # A toy paired data set: texts are a fixed linear view of the images plus noise.
    g = torch.Generator().manual_seed(1)
    proj = torch.randn(32, 24, generator=g)
    for step in range(20):
        g_step = torch.Generator().manual_seed(1000 + step * world + rank)
        n = 64 if rank < world - 1 else 40           # uneven: short batch on the last rank
        images = torch.randn(n, 32, generator=g_step)
        texts = images @ proj + 0.1 * torch.randn(n, 24, generator=g_step)

        img_emb, txt_emb, scale = model(images, texts)
        loss = contrax.clip_loss(img_emb, txt_emb, scale)  # group: the default group
        opt.zero_grad()
        loss.backward()
        opt.step()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)                       # the global mean loss: average of L_r
        if rank == 0 and step % 5 == 4:
            print(f"step {step + 1:2d}  loss {mean_loss.item() / world:.4f}  "
                  f"scale {scale.exp().item():.2f}", flush=True)

    if rank == 0:
        stats = contrax.communicator().stats()
        print("contrax traffic per rank:", {k: v["bytes_sent"] for k, v in stats.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
