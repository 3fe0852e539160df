"""Contrax: exact distributed contrastive losses for PyTorch.

Every loss computes ``[local x global]`` logits: this rank's rows against the
rows of all ranks (gathered with a differentiable all-gather whose backward is a
reduce-scatter), and returns ``L_r = (W / B) * sum_{i in rank r} l_i``, so that
the data-parallel average over ranks (what DistributedDataParallel's gradient
averaging computes) is exactly the mean loss over the global batch of ``B``
rows, also when ranks hold different numbers of rows (a short last batch, even
an empty rank).

``group=`` takes a ``torch.distributed`` ``ProcessGroup``. When omitted it is
the default group if ``torch.distributed`` is initialised, and otherwise the
losses are the plain single-device losses; ``group=contrax.LOCAL`` asks for
those (this rank's rows only, no collective) even when it is initialised.

Argument errors raise ``ValueError`` with the C++ library's message (naming the
argument), on every rank; other failures (e.g. a peer that died) raise
``RuntimeError``.

    loss = contrax.clip_loss(img, txt, logit_scale)
    loss.backward()

``GradCache`` (pure Python, ``contrax/grad_cache.py``) runs a contrastive step
over a batch larger than activation memory allows, with the exact big-batch
gradients: see its docstring.
"""
import atexit
from typing import List, Tuple, Union

import torch

from . import _build_info


def _check_torch() -> None:
    """The extension runs only under the torch it was compiled against: another
    version (or C++ ABI) would fail with undefined symbols or worse."""
    built, abi = _build_info.TORCH_VERSION, _build_info.TORCH_CXX11_ABI
    if torch.__version__ != built or int(torch.compiled_with_cxx11_abi()) != abi:
        raise ImportError(
            "contrax was built against torch %s (C++11 ABI %d), but this interpreter imports torch %s "
            "(C++11 ABI %d) from %s; rebuild contrax against this torch: "
            "python -m pip install --no-build-isolation --force-reinstall %s/python"
            % (built, abi, torch.__version__, int(torch.compiled_with_cxx11_abi()),
               torch.__path__[0], _build_info.SOURCE_DIR))


_check_torch()


class _Local:
    """The type of ``contrax.LOCAL``."""

    def __repr__(self) -> str:
        return "contrax.LOCAL"


#: ``group=contrax.LOCAL``: the single-device loss over this rank's rows, with
#: no collective, whether or not ``torch.distributed`` is initialised.
LOCAL = _Local()
# (Defined before the modules below import it.)

from . import _contrax, _signatures, modules  # noqa: E402
from . import _ops  # noqa: E402  (the operators' fake kernels and autograd, for torch.compile)
from .grad_cache import GradCache, GradCacheEncoder
from .modules import ClipLoss, GroupedLoss, MaxSimLoss, MoCoV3Loss, NTXentLoss, SigLIPLoss

__all__ = [
    "LOCAL",
    *_signatures.LOSSES,
    "gather_with_grad",
    "gather_no_grad",
    "grad_cache_inject",
    "momentum_schedule",
    "momentum_update",
    "communicator",
    "clear_cache",
    "set_keep_loss_workspace",
    "loss_workspace_bytes",
    "release_loss_workspace",
    "GradCache",
    "GradCacheEncoder",
    *modules.__all__,
]

__version__ = "0.1.0"


def _comm(group):
    """The cached C++ communicator for ``group`` (see module docstring)."""
    if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        group = torch.distributed.group.WORLD
    return _contrax.communicator(None if group is LOCAL else group)


def communicator(group=None):
    """The contrax communicator for ``group`` (cached per process group).

    Its ``rank``, ``world_size``, ``backend`` and ``stats()`` (bytes sent and
    calls per collective since the last ``reset_stats()``) describe what the
    losses did over that group. Setting ``static_shapes = True`` on every rank
    promises equal batch shapes on all ranks: each loss then skips its
    row-count exchange (under NCCL a host synchronisation per call), and a bad
    argument is raised on its own rank only (the others wait until the
    timeout).
    """
    return _comm(group)


def clear_cache() -> None:
    """Drops every cached communicator (and its reference to the process group).

    Entries of destroyed groups are dropped automatically, and at interpreter
    exit. To free a group at once, call this *after*
    ``torch.distributed.destroy_process_group()``: the group is then freed here,
    with the GIL released while Gloo joins its worker threads (a worker may
    need the GIL to free a finished operation's tensors, so freeing the group
    inside ``destroy_process_group()``, with the GIL held, can deadlock).
    """
    _contrax.clear_cache()


def set_keep_loss_workspace(keep: bool) -> None:
    """Whether a materialised loss's CPU logits buffer (32 MiB or more) is kept
    by the calling thread between calls (default: yes, unless the environment
    has ``CONTRAX_KEEP_WORKSPACE=0``). Reusing it saves faulting in every page
    of a fresh buffer on every call (docs/benchmarks.md measures what that
    costs); the price is that it stays resident. ``False`` also releases it.
    CUDA tensors are not affected."""
    _contrax.set_keep_loss_workspace(bool(keep))


def loss_workspace_bytes() -> int:
    """Bytes of the logits buffer the calling thread keeps (0: none)."""
    return _contrax.loss_workspace_bytes()


def release_loss_workspace() -> None:
    """Frees the logits buffer the calling thread keeps (a loss whose backward
    has not run yet keeps it alive until then)."""
    _contrax.release_loss_workspace()


# A group whose last reference is the cache's (the user called
# torch.distributed.destroy_process_group()) would otherwise stay alive into
# interpreter finalization, its Gloo worker threads with it; a worker that then
# frees a finished work item's Python-owned tensor takes the GIL and is ended
# by Python (SIGABRT: "terminate called without an active exception"). At exit,
# while the interpreter is whole, free such groups (clear_cache releases the GIL
# while the group joins its threads).
atexit.register(_contrax.clear_cache)


def _loss(name: str):
    """The public function of loss ``name``, from its table (contrax/_signatures.py):
    eagerly the binding's function (one fused autograd function per loss) with
    the group's communicator; while ``torch.compile`` traces, the operator
    (contrax/_ops.py) with the group's name. Both take the table's order."""
    loss = _signatures.LOSSES[name]
    casts = [_signatures.cast(p) for p in loss.params]
    names = [p.name for p in loss.params]
    at = names.index("group")
    eager, op = getattr(_contrax, name), getattr(torch.ops.contrax, name)

    def impl(*values):
        values = [c(v, name) for c, v in zip(casts, values)]
        if torch.compiler.is_compiling():
            values[at] = _ops.group_name(values[at])
            return op(*values)
        values[at] = _comm(values[at])
        return eager(*values)

    return _signatures.function(loss, impl, __name__)


clip_loss = _loss("clip_loss")
grouped_loss = _loss("grouped_loss")
nt_xent_loss = _loss("nt_xent_loss")
moco_v3_loss = _loss("moco_v3_loss")
siglip_loss = _loss("siglip_loss")
maxsim_loss = _loss("maxsim_loss")


def gather_with_grad(x: torch.Tensor, group=None, *, return_counts: bool = False
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, List[int], int]]:
    """Differentiable all-gather of rows.

    Args:
        x: ``[b_r, ...]`` on every rank; same trailing shape and dtype
            everywhere (checked), ``b_r`` may differ.
        group: ``torch.distributed`` ProcessGroup or None.
        return_counts: also return the per-rank row counts and this rank's offset.

    Returns:
        ``[B, ...]``: the rows of all ranks in rank order (``x`` itself in a
        world of 1); with ``return_counts`` a tuple ``(all, counts, offset)``.
        The backward is a reduce-scatter with SUM: this rank's rows receive the
        sum over ranks of the gradient of their slice.
    """
    if torch.compiler.is_compiling():
        if return_counts:
            raise ValueError("gather_with_grad(): argument 'return_counts' must be False under torch.compile (the "
                             "per-rank counts are known only when it runs)")
        return _ops.gather_with_grad(x, group)
    all_rows, counts, offset = _contrax.gather(x, True, _comm(group))
    return (all_rows, counts, offset) if return_counts else all_rows


def gather_no_grad(x: torch.Tensor, group=None, *, return_counts: bool = False
                   ) -> Union[torch.Tensor, Tuple[torch.Tensor, List[int], int]]:
    """All-gather of rows without gradient (momentum keys, evaluation).

    Same checks, uneven sizes and return value as ``gather_with_grad``; the
    result is detached.
    """
    all_rows, counts, offset = _contrax.gather(x, False, _comm(group))
    return (all_rows, counts, offset) if return_counts else all_rows


def grad_cache_inject(rep: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """GradCache's pass 2 as an operator (``torch.ops.contrax.grad_cache_inject``):
    a 0-dim zero whose backward gives ``rep`` the gradient ``grad``, times the
    gradient reaching it. ``grad_cache_inject(encoder(chunk), cached).backward()``
    is ``torch.autograd.backward(encoder(chunk), cached)`` in a form that
    ``torch.compile(fullgraph=True)`` traces with the encoder.
    """
    return _ops.grad_cache_inject(rep, grad)


def momentum_schedule(base: float, step: int, total_steps: int) -> float:
    """MoCo v3's cosine momentum: ``1 - (1 - base) * (cos(pi * step / total_steps) + 1) / 2``."""
    return _contrax.momentum_schedule(float(base), int(step), int(total_steps))


@torch.no_grad()
def momentum_update(target: torch.nn.Module, online: torch.nn.Module, momentum: float) -> None:
    """EMA update ``target = m * target + (1 - m) * online``, parameter by parameter.

    Both modules must have the same parameter names and shapes. Buffers are
    left as they are.
    """
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum_update(): argument 'momentum' must be in [0, 1], but got {momentum}")
    tp = dict(target.named_parameters())
    op = dict(online.named_parameters())
    if tp.keys() != op.keys():
        raise ValueError("momentum_update(): arguments 'target' and 'online' must have the same parameters")
    for name, p in op.items():
        t = tp[name]
        if t.shape != p.shape:
            raise ValueError(f"momentum_update(): parameter '{name}' has shape {list(t.shape)} in 'target' "
                             f"and {list(p.shape)} in 'online'")
        t.mul_(momentum).add_(p.detach(), alpha=1.0 - momentum)
