"""Helpers for the contrax Python tests: Gloo ranks (on the session's shared
rank processes, rank_pool.py), reference losses."""
import datetime
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import contrax
import rank_pool

F64 = torch.float64


def _entry(rank, world, init_file, fn, args, timeout_s=60):
    torch.set_num_threads(1)
    # A short timeout: a test whose ranks issue mismatched collectives fails
    # in a minute instead of hanging for torch's default 30.
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        _teardown()


def _teardown():
    """Frees the default group in contrax.clear_cache(), which releases the GIL
    while ~ProcessGroupGloo joins its worker threads: a worker may still be
    freeing a finished work item's Python-owned tensors, which needs the GIL.
    Not in destroy_process_group() (its last reference dropped with the GIL
    held: a deadlock) nor at interpreter exit (the worker's GIL request ends
    the thread: SIGABRT). So the cache must hold the group, and last."""
    dist.barrier()
    contrax.communicator()  # cached (world > 1): destroy_process_group() does not free it
    dist.destroy_process_group()
    gc.collect()  # DDP reducers in reference cycles hold the group as well
    contrax.clear_cache()


def _init_file():
    fd, init_file = tempfile.mkstemp(prefix="contrax_pytest_")
    os.close(fd)
    os.unlink(init_file)  # FileStore creates it
    return init_file


def run(world, fn, *args):
    """Runs fn(rank, world, *args) on `world` Gloo ranks (FileStore rendezvous)
    of the session's rank processes (rank_pool.py: each call a fresh group,
    and a fresh process's settings); an exception on any rank fails the
    caller with its traceback. The first call of a world larger than any
    before starts the processes it lacks (seconds each): --durations charges
    them to that case (in python_tests, test_ddp's two)."""
    run_ranks(world, fn, args)


def run_ranks(world, fn, args, timeout_s=60):
    """run() with the group's timeout (seconds) as a parameter."""
    init_file = _init_file()
    try:
        rank_pool.shared().run(world, _entry, (world, init_file, fn, args, timeout_s),
                               f"{fn.__module__}.{fn.__qualname__}")
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def spawn(world, fn, *args):
    """run() on `world` freshly spawned processes, for a case that needs what
    only a new process has (say why where it is called): seconds slower."""
    init_file = _init_file()
    try:
        mp.spawn(_entry, args=(world, init_file, fn, args), nprocs=world, join=True)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def offsets(rows, rank):
    return sum(rows[:rank]), rows[rank]


def rel_err(got, want):
    scale = max(want.abs().max().item(), 1e-300)
    return (got - want).abs().max().item() / scale


# ---- plain single-process PyTorch references on the concatenated batch ------

def clip_ref(a, b, log_scale, bias=None, symmetric=True, max_logit_scale=100.0, normalize=False):
    if normalize:
        a, b = F.normalize(a, dim=1), F.normalize(b, dim=1)
    logits = a @ b.t() * log_scale.exp().clamp(max=max_logit_scale)
    if bias is not None:
        logits = logits + bias
    target = torch.arange(a.shape[0])
    loss = F.cross_entropy(logits, target)
    if symmetric:
        loss = (loss + F.cross_entropy(logits.t(), target)) / 2
    return loss


def nt_xent_ref(z1, z2, temperature=0.1, normalize=True):
    if normalize:
        z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    n = z1.shape[0]
    self_mask = torch.eye(n, dtype=torch.bool)
    target = torch.arange(n)

    def side(x, y):
        cross = x @ y.t() / temperature
        same = (x @ x.t() / temperature).masked_fill(self_mask, float("-inf"))
        return F.cross_entropy(torch.cat([cross, same], dim=1), target)

    return (side(z1, z2) + side(z2, z1)) / 2


def moco_v3_ref(q1, q2, k1, k2, temperature=1.0, normalize=True):
    if normalize:
        q1, q2, k1, k2 = (F.normalize(t, dim=1) for t in (q1, q2, k1, k2))
    target = torch.arange(q1.shape[0])

    def ctr(q, k):
        return F.cross_entropy(q @ k.detach().t() / temperature, target) * 2 * temperature

    return ctr(q1, k2) + ctr(q2, k1)


def siglip_ref(a, b, log_scale, bias=None, normalize=False):
    if normalize:
        a, b = F.normalize(a, dim=1), F.normalize(b, dim=1)
    logits = a @ b.t() * log_scale.exp()
    if bias is not None:
        logits = logits + bias
    z = 2 * torch.eye(a.shape[0], dtype=a.dtype) - 1
    return -F.logsigmoid(z * logits).sum() / a.shape[0]


def matryoshka_ref(loss, dims, weights, *features):
    """Matryoshka: sum_p w_p loss(every feature's first m_p columns, rows
    L2-normalised), a plain loop over ``dims`` (weights 1 when empty) and the
    full width (weight 1 when not listed)."""
    width = features[0].shape[1]
    prefixes = list(zip(dims, weights or [1.0] * len(dims)))
    if width not in dims:
        prefixes.append((width, 1.0))
    return sum(w * loss(*(F.normalize(x[:, :m], dim=1) for x in features)) for m, w in prefixes)
