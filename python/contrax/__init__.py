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
from typing import List, Optional, Tuple, Union

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

from . import _contrax  # noqa: E402
from . import _ops  # noqa: E402  (the operators' fake kernels and autograd, for torch.compile)
from .grad_cache import GradCache, GradCacheEncoder
from .modules import ClipLoss, GroupedLoss, MoCoV3Loss, NTXentLoss, SigLIPLoss

__all__ = [
    "LOCAL",
    "clip_loss",
    "grouped_loss",
    "nt_xent_loss",
    "moco_v3_loss",
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
    "tiled_clip_loss",
    "tiled_nt_xent_loss",
    "tiled_moco_v3_loss",
    "siglip_loss",
    "GradCache",
    "GradCacheEncoder",
    "ClipLoss",
    "NTXentLoss",
    "MoCoV3Loss",
    "SigLIPLoss",
    "GroupedLoss",
]

__version__ = "0.1.0"


def _comm(group):
    """The cached C++ communicator for ``group`` (see module docstring)."""
    if group is LOCAL:
        return _contrax.communicator(None)
    if group is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        else:
            return _contrax.communicator(None)
    return _contrax.communicator(group)


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


def clip_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor,
              logit_bias: Optional[torch.Tensor] = None, *, symmetric: bool = True,
              max_logit_scale: float = 100.0, normalize: bool = False,
              labels: Optional[torch.Tensor] = None, label_mode: str = "multi_positive",
              reduction: str = "mean", path: str = "auto", tile_size: int = 0, ring: bool = False,
              group=None) -> torch.Tensor:
    """CLIP / InfoNCE loss over the global batch.

    Args:
        a, b: ``[b_r, d]`` paired features on this rank (row i of ``a`` matches
            row i of ``b``); ranks may hold different ``b_r`` (even 0).
        logit_scale: 0-dim tensor, the *log* of the scale (CLIP's learnable
            parameter); logits are ``a @ b_all.T * min(exp(logit_scale), max_logit_scale)``.
        logit_bias: optional 0-dim bias added to every logit.
        symmetric: ``(CE(a->b) + CE(b->a)) / 2`` if True, else ``CE(a->b)`` (InfoNCE).
        max_logit_scale: clamp of ``exp(logit_scale)``.
        normalize: L2-normalise ``a`` and ``b`` inside the loss.
        labels: optional int64 ``[b_r]``, this rank's rows' labels (gathered
            inside). Rows with equal labels are positives of each other
            (``label_mode="multi_positive"``: ``l_i = lse_i - mean of the
            positives' logits``) or removed from each other's softmax
            (``"mask_duplicates"``: false-negative masking).
        label_mode: ``"multi_positive"`` or ``"mask_duplicates"``.
        reduction: ``"mean"`` (``L_r = (W/B) sum_{i in r} l_i``), ``"sum"``
            (``W sum_{i in r} l_i``) or ``"none"`` (the ``[b_r]`` per-row losses,
            each the exact global-batch loss of that row; every rank must run
            backward, which all-gathers the upstream gradients when symmetric).
        path: memory path, as every loss spells it: ``"auto"`` (default:
            materialise the ``[b x B]`` logits while they take at most 256 MiB
            per rank, else tiled), ``"materialised"`` or ``"tiled"`` (memory
            ``O(b x tile)``, same value and gradients).
        tile_size: tiled path: the tile side (0: about 16 MiB per tile); a
            positive value with ``path="auto"`` selects tiles. -1 is the
            deprecated spelling of ``path="materialised"`` (warns).
        ring: tiled path (implied): key blocks travel around the ring.
        group: ``torch.distributed`` ProcessGroup (default: the default group
            if initialised, else single device).

    Returns:
        0-dim tensor ``L_r = (W/B) * sum of this rank's per-row losses`` (see
        ``reduction``); differentiable in ``a``, ``b``, ``logit_scale`` and
        ``logit_bias``.

    Raises:
        ValueError: bad argument (on every rank; the others name the failing rank).
        RuntimeError: a collective failed (e.g. a peer died).
    """
    if torch.compiler.is_compiling():
        return _ops.clip_loss(a, b, logit_scale, logit_bias, labels, symmetric, max_logit_scale, normalize,
                              label_mode, reduction, path, tile_size, ring, group)
    return _contrax.clip_loss(a, b, logit_scale, logit_bias, symmetric, float(max_logit_scale),
                              normalize, _comm(group), labels, label_mode, reduction, path, int(tile_size),
                              bool(ring))


def grouped_loss(queries: torch.Tensor, candidates: torch.Tensor, logit_scale: torch.Tensor,
                 logit_bias: Optional[torch.Tensor] = None, *, labels: Optional[torch.Tensor] = None,
                 candidate_labels: Optional[torch.Tensor] = None, label_mode: str = "mask_duplicates",
                 reduction: str = "mean", max_logit_scale: float = 100.0, normalize: bool = False,
                 path: str = "auto", tile_size: int = 0, ring: bool = False, group=None) -> torch.Tensor:
    """DPR/Tevatron-style retrieval loss with hard negatives over the global batch.

    Args:
        queries: ``[b_r, d]``.
        candidates: ``[b_r * g, d]``, grouped per query: rows ``i*g .. i*g+g-1``
            belong to query i, its positive first, then ``g-1`` hard negatives.
            ``g`` must be the same on every rank (a rank may hold 0 queries).
            Every candidate of every rank is a negative of every other query.
        logit_scale: 0-dim, the *log* of the scale (as in ``clip_loss``).
        logit_bias: optional 0-dim bias.
        labels: optional int64 ``[b_r]``, the id of each query's positive.
        candidate_labels: optional int64 ``[b_r * g]``, the id of each candidate
            (required with ``labels`` when ``g > 1``).
        label_mode: ``"mask_duplicates"`` (default: a candidate carrying the
            query's id, other than its own positive, leaves the softmax) or
            ``"multi_positive"`` (it counts as another positive).
        reduction: ``"mean"`` over the global number of queries, ``"sum"`` or
            ``"none"`` (see ``clip_loss``).
        path, tile_size, ring: the memory path (see ``clip_loss``); with
            ``ring`` the candidate blocks travel around the ring.
        group: ``torch.distributed`` ProcessGroup or None (see ``clip_loss``).

    Returns:
        ``l_i = lse_i - S_{i, pos(i)}`` reduced as ``reduction`` says;
        differentiable in ``queries``, ``candidates``, ``logit_scale`` and ``logit_bias``.
    """
    if torch.compiler.is_compiling():
        return _ops.grouped_loss(queries, candidates, logit_scale, logit_bias, labels, candidate_labels, label_mode,
                                 reduction, max_logit_scale, normalize, path, tile_size, ring, group)
    return _contrax.grouped_loss(queries, candidates, logit_scale, logit_bias, labels, candidate_labels,
                                 label_mode, reduction, float(max_logit_scale), normalize, int(tile_size),
                                 bool(ring), _comm(group), path)


def nt_xent_loss(z1: torch.Tensor, z2: torch.Tensor, *, temperature: float = 0.1,
                 normalize: bool = True, reduction: str = "mean", path: str = "auto", tile_size: int = 0,
                 ring: bool = False, group=None) -> torch.Tensor:
    """SimCLR's NT-Xent loss over the global batch of ``2B`` views.

    For view-1 row i the logits are ``[z1_i . z2_all | z1_i . z1_all] / T`` with
    its own column in the second block masked out (likewise for view 2); the
    loss is the mean over all ``2B`` rows, per-rank weighted as in ``clip_loss``.

    Args:
        z1, z2: ``[b_r, d]`` projections of the two views of the same images.
        temperature: softmax temperature, > 0.
        normalize: L2-normalise inside the loss (cosine similarity).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (``[b_r]``) over the
            ``B`` examples (an example's loss is the mean of its two views').
        path, tile_size, ring: the memory path (see ``clip_loss``).
        group: ``torch.distributed`` ProcessGroup or None (see ``clip_loss``).

    Returns:
        0-dim tensor, differentiable in ``z1`` and ``z2``.
    """
    if torch.compiler.is_compiling():
        return _ops.nt_xent_loss(z1, z2, temperature, normalize, reduction, path, tile_size, ring, group)
    return _contrax.nt_xent_loss(z1, z2, float(temperature), normalize, _comm(group), reduction, path,
                                 int(tile_size), bool(ring))


def moco_v3_loss(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, *,
                 temperature: float = 1.0, normalize: bool = True, reduction: str = "mean",
                 path: str = "auto", tile_size: int = 0, ring: bool = False, group=None) -> torch.Tensor:
    """MoCo v3's symmetrised loss ``ctr(q1, k2) + ctr(q2, k1)``.

    ``ctr(q, k) = CE(q @ k_all.T / T, positives) * 2T``; the keys (momentum
    encoder outputs) are gathered without gradient.

    Args:
        q1, q2: ``[b_r, d]`` queries (with gradient).
        k1, k2: ``[b_r, d]`` keys (treated as constants).
        temperature: softmax temperature (MoCo v3 ViT uses 0.2).
        normalize: L2-normalise queries and keys inside the loss.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` over the ``B`` examples
            (an example's loss is ``2T (l(q1_i, k2) + l(q2_i, k1))``).
        path, tile_size, ring: the memory path (see ``clip_loss``).
        group: ``torch.distributed`` ProcessGroup or None (see ``clip_loss``).

    Returns:
        0-dim tensor (``[b_r]`` with ``"none"``), differentiable in ``q1`` and ``q2``.
    """
    if torch.compiler.is_compiling():
        return _ops.moco_v3_loss(q1, q2, k1, k2, temperature, normalize, reduction, path, tile_size, ring, group)
    return _contrax.moco_v3_loss(q1, q2, k1, k2, float(temperature), normalize, _comm(group), reduction, path,
                                 int(tile_size), bool(ring))


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


# ---- memory-bounded variants: tiled / ring, SigLIP ---------------------------

def tiled_clip_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor,
                    logit_bias: Optional[torch.Tensor] = None, *, symmetric: bool = True,
                    max_logit_scale: float = 100.0, normalize: bool = False, tile_size: int = 0,
                    ring: bool = False, group=None) -> torch.Tensor:
    """``clip_loss`` computed tile by tile, with the same value and gradients.

    Row-wise log-sum-exp accumulated over column tiles (online softmax); the
    backward recomputes each tile, so memory is ``O(b_r x tile)`` instead of
    ``O(b_r x B)``.

    Args:
        a, b, logit_scale, logit_bias, symmetric, max_logit_scale, normalize:
            as in ``clip_loss``.
        tile_size: rows/columns per tile (> 0), or 0 for about 16 MiB of
            logits per tile.
        ring: pass the key blocks around the ring of ranks (neighbour
            exchange, overlapped with the tile compute) instead of gathering
            them; every rank must pass the same value.
        group: ``torch.distributed`` ProcessGroup or None (see ``clip_loss``).

    Returns:
        0-dim tensor ``L_r``, as ``clip_loss``.
    """
    if torch.compiler.is_compiling():
        return _ops.clip_loss(a, b, logit_scale, logit_bias, None, symmetric, max_logit_scale, normalize,
                              "multi_positive", "mean", "tiled", tile_size, ring, group)
    return _contrax.tiled_clip_loss(a, b, logit_scale, logit_bias, symmetric, float(max_logit_scale),
                                    normalize, int(tile_size), bool(ring), _comm(group))


def tiled_nt_xent_loss(z1: torch.Tensor, z2: torch.Tensor, *, temperature: float = 0.1,
                       normalize: bool = True, tile_size: int = 0, ring: bool = False,
                       group=None) -> torch.Tensor:
    """``nt_xent_loss`` computed tile by tile (optionally around the ring); see ``tiled_clip_loss``."""
    if torch.compiler.is_compiling():
        return _ops.nt_xent_loss(z1, z2, temperature, normalize, "mean", "tiled", tile_size, ring, group)
    return _contrax.tiled_nt_xent_loss(z1, z2, float(temperature), normalize, int(tile_size), bool(ring),
                                       _comm(group))


def tiled_moco_v3_loss(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, *,
                       temperature: float = 1.0, normalize: bool = True, tile_size: int = 0,
                       ring: bool = False, group=None) -> torch.Tensor:
    """``moco_v3_loss`` computed tile by tile (optionally around the ring); see ``tiled_clip_loss``."""
    if torch.compiler.is_compiling():
        return _ops.moco_v3_loss(q1, q2, k1, k2, temperature, normalize, "mean", "tiled", tile_size, ring, group)
    return _contrax.tiled_moco_v3_loss(q1, q2, k1, k2, float(temperature), normalize, int(tile_size),
                                       bool(ring), _comm(group))


def siglip_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: Optional[torch.Tensor] = None, *, max_logit_scale: float = float("inf"),
                normalize: bool = False, chunk_size: int = 0, group=None) -> torch.Tensor:
    """SigLIP's pairwise sigmoid loss over the global batch.

    ``loss = -(1/B) sum_i sum_j log sigmoid(z_ij (exp(logit_scale) a_i.b_j + bias))``
    with ``z_ij = +1`` on the diagonal and ``-1`` elsewhere. The ``b`` blocks
    travel around the ring of ranks (no gather); logits exist one
    ``[chunk x chunk]`` tile at a time (``chunk_size`` 0: about 16 MiB).
    Per-rank weighting as in ``clip_loss``.

    Args:
        a, b: ``[b_r, d]`` paired features.
        logit_scale: 0-dim log scale (SigLIP initialises it to log 10).
        logit_bias: optional 0-dim bias (SigLIP: -10).
        max_logit_scale: clamp of ``exp(logit_scale)`` (default none).
        normalize: L2-normalise ``a`` and ``b`` inside the loss.
        chunk_size: rows/columns per logits tile (> 0), or 0 for about 16 MiB.
        group: ``torch.distributed`` ProcessGroup or None.

    Returns:
        0-dim tensor ``L_r``, differentiable in ``a``, ``b``, ``logit_scale``
        and ``logit_bias``.
    """
    if torch.compiler.is_compiling():
        return _ops.siglip_loss(a, b, logit_scale, logit_bias, max_logit_scale, normalize, chunk_size, group)
    return _contrax.siglip_loss(a, b, logit_scale, logit_bias, float(max_logit_scale), normalize,
                                int(chunk_size), _comm(group))


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
