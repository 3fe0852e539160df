"""Runs the plain PyTorch DDP peer of the default recipe on GPUs.

The peer (``simclr_torch_ddp.py``, from ../shared/peers, carried in the
offline bundle by tools/gpu_bundle.sh) is written for the CPU over Gloo. This
driver runs it unchanged but for where its tensors live, as a practitioner
would move it to a GPU: NCCL, each rank on GPU ``LOCAL_RANK``, the model
there, the views augmented on the CPU (as ``contrax train --device cuda``
does) and copied over, the loss's masks and labels made on the features'
device. Everything else (model, recipe, sampler, optimiser, timing) is the
peer's own, so its examples/s stand beside Contrax's on the same GPU.

    python tools/peer_gpu.py PEER.py --spawn 1 --data DIR --max-steps 300 --no-eval --json
"""
import importlib.util
import os
import sys

import torch
import torch.distributed as dist


def load(path):
    spec = importlib.util.spec_from_file_location("simclr_torch_ddp", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def on_gpus(peer):
    """Moves the peer's tensors onto the rank's GPU (see the module's text)."""
    init = dist.init_process_group

    def init_nccl(backend=None, **kwargs):
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        init("nccl", device_id=device, **kwargs)

    peer.dist.init_process_group = init_nccl

    class CudaModel(peer.SimCLR):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.to(torch.cuda.current_device())

    peer.SimCLR = CudaModel
    augment, loss = peer.augment_batch, peer.nt_xent
    peer.augment_batch = lambda x, gen: augment(x, gen).to(torch.cuda.current_device(), non_blocking=True)

    def loss_on_device(z1, z2, temperature):
        with torch.device(z1.device):
            return loss(z1, z2, temperature)

    peer.nt_xent = loss_on_device


def worker(rank, world, peer_path, args):
    """One rank: the peer loaded and moved in this process (spawn starts afresh)."""
    peer = load(peer_path)
    on_gpus(peer)
    peer.main_worker(rank, world, args)


def main():
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        print("usage: peer_gpu.py PEER.py [the peer's arguments]", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("peer_gpu.py: no GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        sys.exit(3)
    path = os.path.abspath(sys.argv[1])
    args = load(path).parse_args(sys.argv[2:])
    if args.spawn > 0:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.multiprocessing.spawn(worker, args=(args.spawn, path, args), nprocs=args.spawn)
    else:
        worker(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), path, args)


if __name__ == "__main__":
    main()
