"""open_clip's ``ClipLoss`` and ``SigLipLoss``, computed exactly by Contrax.

The swap (open_clip_train/main.py, or any loop that builds open_clip's loss)::

    from open_clip import create_loss                              # before
    from contrax.integrations.open_clip import create_loss         # after

or ``open_clip.ClipLoss(...)`` -> ``contrax.integrations.open_clip.ClipLoss(...)``
with the same arguments. The training loop is unchanged: the loss is called as
open_clip calls it, ``loss(**model_out, output_dict=True)``, with
``logit_scale`` the scale itself (``model.logit_scale.exp()``, not its log)
and ``logit_bias`` the bias.

What changes underneath (docs/integrations.md says more, and what is tested):
the features are always gathered with gradient, so the gradients are exact
whatever ``local_loss`` / ``gather_with_grad`` say (open_clip's defaults give
every parameter but the scale 1/W of its gradient under DDP); ``local_loss``
only chooses the value returned, this rank's share ``L_r = (W/B) sum_{i in r}
l_i`` or the global batch's loss on every rank. Ranks may hold different
numbers of rows (open_clip's gathers abort then). CLIP's logits are tiled
above 256 MiB per rank (``path=``, ``tile_size=``, ``ring=`` to choose),
SigLIP's always, the text blocks passed around the ring. ``group=`` spans
another ProcessGroup; ``cache_labels`` and ``dist_impl`` choose nothing;
``use_horovod=True`` is refused.
"""
from typing import Optional

import torch

from .. import clip_loss, siglip_loss
from ._groups import mean_over_ranks, open_clip_group, scalar_tensor, set_memory_path

__all__ = ["ClipLoss", "SigLipLoss", "create_loss"]


class _OpenClipLoss(torch.nn.Module):
    """What both losses share: open_clip's ``cache_labels``, ``rank`` and
    ``world_size``, Contrax's ``group``, and ``forward`` as open_clip calls it,
    which turns open_clip's scale and bias into Contrax's arguments and
    returns ``_loss``'s value (as ``{"contrastive_loss": loss}`` when
    ``output_dict``)."""

    def __init__(self, cache_labels: bool, rank: int, world_size: int):
        super().__init__()
        self.cache_labels = bool(cache_labels)
        self.rank = int(rank)
        self.world_size = int(world_size)

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale,
                logit_bias=None, output_dict: bool = False):
        """The loss of paired ``[b_r, d]`` features, ``logits = logit_scale *
        image @ text_all.T + logit_bias`` (see the class)."""
        where = type(self).__name__ + ".forward()"
        group = open_clip_group(self.rank, self.world_size, self.group, where)
        # open_clip passes the scale; Contrax takes its log (exp(log s) = s, and
        # the gradient reaching the caller's scale is the same either way).
        log_scale = scalar_tensor(logit_scale, image_features, "logit_scale", where).log()
        bias = None if logit_bias is None else scalar_tensor(logit_bias, image_features, "logit_bias", where)
        loss = self._loss(image_features, text_features, log_scale, bias, group)
        return {"contrastive_loss": loss} if output_dict else loss


class ClipLoss(_OpenClipLoss):
    """open_clip's ``ClipLoss`` with exact distributed gradients.

    Arguments of open_clip:
        local_loss: the value returned is this rank's share of the loss (True)
            or the global batch's loss (False, open_clip's default); the
            gradients are the exact ones either way.
        gather_with_grad: accepted; the gather always carries the gradient.
        cache_labels: accepted; nothing to cache.
        rank, world_size: this process's place; ``world_size`` 1 computes the
            loss over this rank's rows alone (as open_clip does), above 1 it
            must match ``torch.distributed``'s default group (or ``group``).
        use_horovod: must be False.

    Contrax keyword arguments:
        path, tile_size, ring: the memory path of ``contrax.clip_loss``.
        group: the ``torch.distributed`` ProcessGroup to span instead of the default one.

    ``forward(image_features, text_features, logit_scale, logit_bias=None,
    output_dict=False)`` as open_clip: the symmetric CLIP loss,
    ``{"contrastive_loss": loss}`` when ``output_dict``, else the loss.
    """

    def __init__(self, local_loss: bool = False, gather_with_grad: bool = False, cache_labels: bool = False,
                 rank: int = 0, world_size: int = 1, use_horovod: bool = False, *, path: str = "auto",
                 tile_size: int = 0, ring: bool = False, group=None):
        super().__init__(cache_labels, rank, world_size)
        if use_horovod:
            raise ValueError("ClipLoss(): argument 'use_horovod' must be False: Contrax runs on "
                             "torch.distributed process groups, not Horovod")
        self.local_loss = bool(local_loss)
        self.gather_with_grad = bool(gather_with_grad)
        self.use_horovod = False
        set_memory_path(self, path, tile_size, ring, group)

    def _loss(self, image, text, log_scale, bias, group):
        # open_clip clamps the scale parameter in its training loop, not in the
        # loss: the dtype's largest finite scale, which no scale reaches.
        no_clamp = float(torch.finfo(log_scale.dtype).max)
        loss = clip_loss(image, text, log_scale, bias, max_logit_scale=no_clamp, path=self.path,
                         tile_size=self.tile_size, ring=self.ring, group=group)
        return loss if self.local_loss else mean_over_ranks(loss, group)


class SigLipLoss(_OpenClipLoss):
    """open_clip's ``SigLipLoss`` (sigmoid loss, SigLIP) computed by Contrax.

    Arguments of open_clip:
        cache_labels: accepted; nothing to cache.
        rank, world_size: as in ``ClipLoss``.
        dist_impl: accepted (``'bidir'``, ``'shift'``, ``'reduce'``, ``'gather'``
            or None); Contrax passes the text blocks around its own ring.

    Contrax keyword arguments:
        tile_size: rows and columns of one logits tile (0: about 16 MiB).
        group: as in ``ClipLoss``.

    ``forward(image_features, text_features, logit_scale, logit_bias=None,
    output_dict=False)``: ``-(1/b) sum_i sum_j log sigmoid(z_ij (logit_scale *
    image_i . text_j + logit_bias))`` over this rank's images against every
    rank's texts (``b`` = this rank's rows when batches are even; ``W/B`` in
    general), this rank's share, as open_clip's.
    """

    def __init__(self, cache_labels: bool = False, rank: int = 0, world_size: int = 1,
                 dist_impl: Optional[str] = None, *, tile_size: int = 0, group=None):
        super().__init__(cache_labels, rank, world_size)
        self.dist_impl = dist_impl or "bidir"
        if self.dist_impl not in ("bidir", "shift", "reduce", "gather"):
            raise ValueError("SigLipLoss(): argument 'dist_impl' must be 'bidir', 'shift', 'reduce', 'gather' or "
                             f"None, but got {dist_impl!r}")
        self.tile_size = int(tile_size)
        self.group = group

    def _loss(self, image, text, log_scale, bias, group):
        # Its text blocks go around the ring.
        return siglip_loss(image, text, log_scale, bias, ring=True, tile_size=self.tile_size, group=group)


def create_loss(args):
    """open_clip's ``create_loss(args)`` (open_clip/factory.py) with Contrax's losses:
    ``SigLipLoss`` when ``args.siglip``, else ``ClipLoss``, from the same fields
    (``local_loss``, ``gather_with_grad``, ``rank``, ``world_size``, ``horovod``,
    ``loss_dist_impl``). Distillation and CoCa's caption loss are open_clip's
    own and not provided: build those with ``open_clip.create_loss``."""
    if getattr(args, "distill", False):
        raise ValueError("create_loss(): args.distill is set; Contrax provides ClipLoss and SigLipLoss, not "
                         "open_clip's DistillClipLoss (use open_clip.create_loss)")
    if "coca" in str(getattr(args, "model", "")).lower():
        raise ValueError(f"create_loss(): args.model is {args.model!r}, a CoCa model; Contrax provides ClipLoss "
                         "and SigLipLoss, not open_clip's CoCaLoss (use open_clip.create_loss)")
    if getattr(args, "siglip", False):
        return SigLipLoss(rank=args.rank, world_size=args.world_size,
                          dist_impl=getattr(args, "loss_dist_impl", None))
    return ClipLoss(local_loss=args.local_loss, gather_with_grad=args.gather_with_grad, cache_labels=True,
                    rank=args.rank, world_size=args.world_size, use_horovod=getattr(args, "horovod", False))
