"""``torch.nn.Module`` forms of the losses.

Each Module holds its loss's options and, where the loss has them, its
learnable parameters, so a training script states them once::

    loss_fn = contrax.ClipLoss(init_scale=1 / 0.07)      # CLIP's initial temperature 0.07
    optimizer = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()])
    loss = loss_fn(img, txt)

The scale convention, made explicit: the constructors take the scale itself
(``init_scale``: CLIP's ``1 / 0.07 = 14.3``, SigLIP's ``10``), and the
parameter the Module learns is its logarithm, ``logit_scale = log(init_scale)``,
as in CLIP. The functional forms take that logarithm; open_clip and Inf-CL
pass the exponentiated value instead, the commonest porting mistake, which
the functions flag with a one-time warning (see ``contrax.clip_loss``).
"""
import math
from typing import Optional

import torch

__all__ = ["ClipLoss", "NTXentLoss", "MoCoV3Loss", "SigLIPLoss", "GroupedLoss"]


def _log_scale_parameter(init_scale: float, what: str) -> torch.nn.Parameter:
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"{what}(): argument 'init_scale' must be a finite scale > 0 (e.g. 1/0.07), "
                         f"but got {init_scale!r}")
    return torch.nn.Parameter(torch.tensor(math.log(init_scale)))


def _register_scale_and_bias(module: torch.nn.Module, init_scale: float, learn_scale: bool,
                             init_bias: Optional[float], what: str) -> None:
    """Gives ``module`` its ``logit_scale`` (the log of ``init_scale``: a parameter,
    or a buffer when not learnt) and ``logit_bias`` (a parameter, or None)."""
    p = _log_scale_parameter(init_scale, what)
    if learn_scale:
        module.logit_scale = p
    else:
        module.register_buffer("logit_scale", p.detach().clone())
    module.logit_bias = None if init_bias is None else torch.nn.Parameter(torch.tensor(float(init_bias)))


class ClipLoss(torch.nn.Module):
    """Module form of ``contrax.clip_loss`` that owns the learnable scale.

    Args:
        init_scale: the initial scale ``exp(logit_scale)`` (CLIP: ``1 / 0.07``);
            the parameter ``logit_scale`` holds its log.
        learn_scale: False keeps the scale fixed (a buffer, not a parameter).
        init_bias: if given, a learnable logit bias with this initial value.
        symmetric, max_logit_scale, normalize, label_mode, reduction, group:
            as in ``contrax.clip_loss``; labels are passed to ``forward``.
        tiled, tile_size, ring: use ``contrax.tiled_clip_loss`` (same value and
            gradients, memory ``O(b_r x tile)``; no labels, mean reduction).
    """

    def __init__(self, *, init_scale: float = 1.0 / 0.07, learn_scale: bool = True,
                 init_bias: Optional[float] = None, symmetric: bool = True, max_logit_scale: float = 100.0,
                 normalize: bool = False, label_mode: str = "multi_positive", reduction: str = "mean",
                 tiled: bool = False, tile_size: int = 0, ring: bool = False, group=None):
        super().__init__()
        _register_scale_and_bias(self, init_scale, learn_scale, init_bias, "ClipLoss")
        self.symmetric = bool(symmetric)
        self.max_logit_scale = float(max_logit_scale)
        self.normalize = bool(normalize)
        self.label_mode = str(label_mode)
        self.reduction = str(reduction)
        self.tiled = bool(tiled)
        if self.tiled and self.reduction != "mean":
            raise ValueError(f"ClipLoss(): argument 'reduction' must be \"mean\" with tiled=True, "
                             f"but got {reduction!r}")
        self.tile_size = int(tile_size)
        self.ring = bool(ring)
        self.group = group

    def scale(self) -> torch.Tensor:
        """The scale the logits are multiplied by: ``min(exp(logit_scale), max_logit_scale)``."""
        return self.logit_scale.detach().exp().clamp(max=self.max_logit_scale)

    def forward(self, a: torch.Tensor, b: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss of paired rows ``a``, ``b`` (``[b_r, d]``) with this Module's scale and bias;
        ``labels`` (int64 ``[b_r]``, optional) as in ``contrax.clip_loss``."""
        from . import clip_loss, tiled_clip_loss
        scale = self.logit_scale.to(a.dtype)
        bias = None if self.logit_bias is None else self.logit_bias.to(a.dtype)
        if self.tiled:
            if labels is not None:
                raise ValueError("ClipLoss.forward(): argument 'labels' is not supported with tiled=True "
                                 "(use contrax.grouped_loss with tile_size for labelled tiled losses)")
            return tiled_clip_loss(a, b, scale, bias, symmetric=self.symmetric,
                                   max_logit_scale=self.max_logit_scale, normalize=self.normalize,
                                   tile_size=self.tile_size, ring=self.ring, group=self.group)
        return clip_loss(a, b, scale, bias, symmetric=self.symmetric, max_logit_scale=self.max_logit_scale,
                         normalize=self.normalize, labels=labels, label_mode=self.label_mode,
                         reduction=self.reduction, group=self.group)

    def extra_repr(self) -> str:
        """The options shown by ``print(module)``."""
        return (f"scale={self.scale().item():.4g}, symmetric={self.symmetric}, "
                f"max_logit_scale={self.max_logit_scale}, bias={self.logit_bias is not None}")


class NTXentLoss(torch.nn.Module):
    """Module form of ``contrax.nt_xent_loss`` (SimCLR). Args as there."""

    def __init__(self, *, temperature: float = 0.1, normalize: bool = True, reduction: str = "mean",
                 group=None):
        super().__init__()
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"NTXentLoss(): argument 'temperature' must be > 0, but got {temperature!r}")
        self.temperature = float(temperature)
        self.normalize = bool(normalize)
        self.reduction = str(reduction)
        self.group = group

    def forward(self, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
        """NT-Xent of the two views' projections ``z1``, ``z2`` (``[b_r, d]``)."""
        from . import nt_xent_loss
        return nt_xent_loss(z1, z2, temperature=self.temperature, normalize=self.normalize,
                            reduction=self.reduction, group=self.group)

    def extra_repr(self) -> str:
        """The options shown by ``print(module)``."""
        return f"temperature={self.temperature}, normalize={self.normalize}"


class MoCoV3Loss(torch.nn.Module):
    """Module form of ``contrax.moco_v3_loss``. Args as there."""

    def __init__(self, *, temperature: float = 1.0, normalize: bool = True, reduction: str = "mean",
                 group=None):
        super().__init__()
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"MoCoV3Loss(): argument 'temperature' must be > 0, but got {temperature!r}")
        self.temperature = float(temperature)
        self.normalize = bool(normalize)
        self.reduction = str(reduction)
        self.group = group

    def forward(self, q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
        """MoCo v3's symmetrised loss of queries ``q1``, ``q2`` and keys ``k1``, ``k2``."""
        from . import moco_v3_loss
        return moco_v3_loss(q1, q2, k1, k2, temperature=self.temperature, normalize=self.normalize,
                            reduction=self.reduction, group=self.group)

    def extra_repr(self) -> str:
        """The options shown by ``print(module)``."""
        return f"temperature={self.temperature}, normalize={self.normalize}"


class SigLIPLoss(torch.nn.Module):
    """Module form of ``contrax.siglip_loss`` that owns the scale and the bias.

    Args:
        init_scale: initial ``exp(logit_scale)`` (SigLIP: 10).
        init_bias: initial bias (SigLIP: -10); None for no bias.
        max_logit_scale, normalize, chunk_size, group: as in ``contrax.siglip_loss``.
    """

    def __init__(self, *, init_scale: float = 10.0, init_bias: Optional[float] = -10.0,
                 max_logit_scale: float = float("inf"), normalize: bool = False, chunk_size: int = 0,
                 group=None):
        super().__init__()
        _register_scale_and_bias(self, init_scale, True, init_bias, "SigLIPLoss")
        self.max_logit_scale = float(max_logit_scale)
        self.normalize = bool(normalize)
        self.chunk_size = int(chunk_size)
        self.group = group

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The sigmoid loss of paired rows ``a``, ``b`` with this Module's scale and bias."""
        from . import siglip_loss
        bias = None if self.logit_bias is None else self.logit_bias.to(a.dtype)
        return siglip_loss(a, b, self.logit_scale.to(a.dtype), bias, max_logit_scale=self.max_logit_scale,
                           normalize=self.normalize, chunk_size=self.chunk_size, group=self.group)

    def extra_repr(self) -> str:
        """The options shown by ``print(module)``."""
        return (f"scale={self.logit_scale.detach().exp().item():.4g}, "
                f"bias={None if self.logit_bias is None else round(self.logit_bias.item(), 4)}")


class GroupedLoss(torch.nn.Module):
    """Module form of ``contrax.grouped_loss`` (queries against grouped candidates:
    each query's positive and hard negatives, every rank's candidates negatives of
    every query) that owns the learnable scale.

    Args:
        init_scale: initial ``exp(logit_scale)`` (e.g. ``1 / 0.05``); the parameter
            ``logit_scale`` holds its log.
        learn_scale: False keeps the scale fixed (a buffer).
        init_bias: if given, a learnable logit bias with this initial value.
        label_mode, reduction, max_logit_scale, normalize, tile_size, ring, group:
            as in ``contrax.grouped_loss``; labels are passed to ``forward``.
    """

    def __init__(self, *, init_scale: float = 1.0 / 0.07, learn_scale: bool = True,
                 init_bias: Optional[float] = None, label_mode: str = "mask_duplicates", reduction: str = "mean",
                 max_logit_scale: float = 100.0, normalize: bool = False, tile_size: int = 0, ring: bool = False,
                 group=None):
        super().__init__()
        _register_scale_and_bias(self, init_scale, learn_scale, init_bias, "GroupedLoss")
        self.label_mode = str(label_mode)
        self.reduction = str(reduction)
        self.max_logit_scale = float(max_logit_scale)
        self.normalize = bool(normalize)
        self.tile_size = int(tile_size)
        self.ring = bool(ring)
        self.group = group

    def forward(self, queries: torch.Tensor, candidates: torch.Tensor, labels: Optional[torch.Tensor] = None,
                candidate_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss of ``queries`` (``[b_r, d]``) against ``candidates`` (``[b_r * g, d]``, per query its
        positive then ``g - 1`` hard negatives); optional int64 ids as in ``contrax.grouped_loss``."""
        from . import grouped_loss
        bias = None if self.logit_bias is None else self.logit_bias.to(queries.dtype)
        return grouped_loss(queries, candidates, self.logit_scale.to(queries.dtype), bias, labels=labels,
                            candidate_labels=candidate_labels, label_mode=self.label_mode,
                            reduction=self.reduction, max_logit_scale=self.max_logit_scale,
                            normalize=self.normalize, tile_size=self.tile_size, ring=self.ring, group=self.group)

    def extra_repr(self) -> str:
        """The options shown by ``print(module)``."""
        return (f"scale={self.logit_scale.detach().exp().item():.4g}, label_mode={self.label_mode}, "
                f"reduction={self.reduction}, bias={self.logit_bias is not None}")
