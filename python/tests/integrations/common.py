"""What the rank workers of the integration tests share: the process group
(from torchrun's environment, or the one a test's rank process made),
comparisons, a data loader of uneven per-rank shares, and a report line per
check."""
import datetime
import gc
import os

import torch
import torch.distributed as dist

import contrax

F64 = torch.float64
GROUP_TIMEOUT_S = 120

_own_group = False


def init():
    """Gloo from torchrun's environment, unless the caller made the group
    already (launch.ranks: the tests' shared rank processes); returns (rank, world)."""
    global _own_group
    torch.set_num_threads(1)
    _own_group = not dist.is_initialized()
    if _own_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return dist.get_rank(), dist.get_world_size()


def finish(rank):
    """Frees the default group the way python/tests/distributed.py explains
    (contrax's cache holds it last and frees it without the GIL), if init()
    made it (else its maker does the same), then says on rank 0 that every
    check held (each report() asserts its own)."""
    if _own_group:
        dist.barrier()
        contrax.communicator()
        dist.destroy_process_group()
        gc.collect()
        contrax.clear_cache()
    if rank == 0:
        print("ALL CHECKS PASSED", flush=True)


def rel_err(got, want):
    got, want = torch.as_tensor(got, dtype=F64), torch.as_tensor(want, dtype=F64)
    scale = max(want.abs().max().item(), 1e-300)
    return (got - want).abs().max().item() / scale


def params_err(model, ref):
    """Largest relative difference over the parameters of two modules with the same names."""
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(rel_err(got[n].detach(), want[n].detach()) for n in got)


def mean_over_ranks(values):
    """The mean over the ranks of per-rank values (a tensor, or a list of
    equally shaped ones, stacked), all-reduced."""
    t = torch.stack(list(values)) if isinstance(values, (list, tuple)) else values.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def sgd_steps(opt, items, loss_of):
    """One optimiser step per item, on the gradient of loss_of(item); returns
    the per-step losses, stacked."""
    values = []
    for item in items:
        loss = loss_of(item)
        loss.backward()
        opt.step()
        opt.zero_grad()
        values.append(loss.detach().clone())
    return torch.stack(values)


def token_column(vocab, rows, length, seed):
    """A tokenised text column: {"input_ids", "attention_mask"} [rows, length], each row
    2 to `length` tokens of [0, vocab) and then padding (id 0, mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int64)
    return {"input_ids": ids * mask, "attention_mask": mask}


def unwrap(model):
    return model.module if hasattr(model, "module") else model


def share(rows, rank):
    """(offset, count) of this rank in a global batch split as `rows`."""
    return sum(rows[:rank]), rows[rank]


def report(rank, name, value, limit, *, above=False):
    """Checks value <= limit (or > limit with above=True) and prints one line on rank 0."""
    ok = value > limit if above else value <= limit
    if rank == 0:
        print(f"CHECK {name}: {value:.3e} {'>' if above else '<='} {limit:g} {'ok' if ok else 'FAILED'}", flush=True)
    assert ok, f"{name}: {value!r} {'>' if above else '<='} {limit!r} does not hold"


def world_env():
    return int(os.environ.get("WORLD_SIZE", "1"))
