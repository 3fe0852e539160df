"""Which ranks a drop-in loss spans, from its library's own arguments, the
value it reports, and the Contrax keyword arguments the drop-ins share.

The peer libraries say "distributed" in their own words (open_clip's
``rank``/``world_size``, lightly's ``gather_distributed``, sentence-transformers'
``gather_across_devices``); this module turns them into a ``group=`` for
Contrax's functions, checked against ``torch.distributed`` so that a
mismatch is an error at the first call instead of a wrong loss.
"""
import torch
import torch.distributed as dist

from .. import LOCAL


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def distributed_group(gather: bool, group, where: str):
    """The ``group=`` of a loss whose library has an on/off switch for gathering.

    ``gather`` False: this rank's rows only (``contrax.LOCAL``). True: ``group``
    if given, else torch.distributed's default group when it is initialised,
    else a single process (both libraries gather nothing then).
    """
    if not gather:
        return LOCAL
    if group is not None:
        if not _initialised():
            raise ValueError(f"{where}: argument 'group' was given, but torch.distributed is not initialised")
        return group
    return None if _initialised() else LOCAL


def open_clip_group(rank: int, world_size: int, group, where: str):
    """The ``group=`` of an open_clip loss: ``world_size`` 1 is one process
    (what open_clip computes then: this rank's rows only); above 1 the default
    group, or ``group``, whose size and rank must be ``world_size`` and ``rank``."""
    if group is None and world_size == 1:
        return LOCAL
    if not _initialised():
        raise ValueError(f"{where}: argument 'world_size' is {world_size}, but torch.distributed is not "
                         "initialised (call torch.distributed.init_process_group first, or pass world_size=1)")
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    if world_size not in (1, size) or (world_size == size and rank != me):
        raise ValueError(f"{where}: arguments 'rank'={rank} and 'world_size'={world_size} do not match the "
                         f"process group (rank {me} of {size})")
    return group


def mean_over_ranks(loss: torch.Tensor, group) -> torch.Tensor:
    """``loss`` with the value ``(1/W) sum_r loss_r`` (the global-batch loss when
    every rank returns its share ``L_r``) and the gradient of ``loss`` itself.

    Libraries that report the global loss on every rank (open_clip's
    ``local_loss=False``) thus log the same number, while data-parallel
    gradient averaging still sees each rank's share, which is what makes the
    gradients exact. One all-reduce of a scalar.
    """
    world = 1 if group is LOCAL or not _initialised() else dist.get_world_size(group)
    if world == 1:
        return loss
    import torch.distributed._functional_collectives as funcol

    pg = group if group is not None else dist.group.WORLD
    total = funcol.all_reduce(loss.detach(), "sum", pg)
    return loss + (total / world - loss.detach())


def scalar_tensor(value, like: torch.Tensor, arg: str, where: str) -> torch.Tensor:
    """A 0-dim tensor from a 0-dim/1-element tensor or a Python number."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"{where}: argument '{arg}' must be a scalar (0-dim) tensor, but got shape "
                             f"{list(value.shape)}")
        return value.reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=like.dtype, device=like.device)
    raise TypeError(f"{where}: argument '{arg}' must be a tensor or a number, but got {type(value).__name__}")


def set_memory_path(loss, path: str, tile_size: int, ring: bool, group) -> None:
    """Sets a drop-in's Contrax keyword arguments: the memory path of its loss
    (``path``, ``tile_size``, ``ring``) and the ``group`` it spans."""
    loss.path, loss.tile_size, loss.ring, loss.group = str(path), int(tile_size), bool(ring), group
