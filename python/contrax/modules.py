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
from __future__ import annotations  # annotations stay source text: tools/gen_stub.py writes them

import inspect
import math
import sys
import textwrap
from typing import Any, Dict, Optional

import torch

from . import _signatures

__all__ = ["ClipLoss", "NTXentLoss", "MoCoV3Loss", "SigLIPLoss", "GroupedLoss", "MaxSimLoss"]


def _register_scale_and_bias(module: torch.nn.Module, init_scale: float, learn_scale: bool,
                             init_bias: Optional[float], what: str) -> None:
    """Gives ``module`` its ``logit_scale`` (the log of ``init_scale``: a parameter,
    or a buffer when not learnt) and ``logit_bias`` (a parameter, or None)."""
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"{what}(): argument 'init_scale' must be a finite scale > 0 (e.g. 1/0.07), "
                         f"but got {init_scale!r}")
    log_scale = torch.tensor(math.log(init_scale))
    if learn_scale:
        module.logit_scale = torch.nn.Parameter(log_scale)
    else:
        module.register_buffer("logit_scale", log_scale)
    module.logit_bias = None if init_bias is None else torch.nn.Parameter(torch.tensor(float(init_bias)))


class _LossModule(torch.nn.Module):
    """A loss's Module: the loss's options (its parameters that are not
    tensors, from its table in contrax/_signatures.py) are the constructor's
    keyword arguments after the subclass's own, its attributes, what every
    forward passes on, what ``print(module)`` shows and the docstring lists."""

    _loss: _signatures.Loss

    def __init_subclass__(cls, loss: Optional[str] = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if loss is None:  # a base of several losses' Modules
            return
        cls._loss = _signatures.LOSSES[loss]
        if "__init__" not in vars(cls):  # its own function, to carry its own signature
            parent = cls.__init__

            def __init__(self, **options):
                parent(self, **options)
            cls.__init__ = __init__
        options = _signatures.options(cls._loss)
        cls.__doc__ = inspect.cleandoc(cls.__doc__) + "\n\n" + textwrap.fill(
            "Options, as in ``contrax.%s``: %s." % (loss, ", ".join(p.name for p in options)), 79)
        own = [p for p in inspect.signature(cls.__init__).parameters.values() if p.kind != p.VAR_KEYWORD]
        cls.__init__.__signature__ = inspect.Signature(own + [
            inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, default=p.default,
                              annotation=_signatures.annotation(p)) for p in options])

    def __init__(self, options: Dict[str, Any]):
        super().__init__()
        what, loss = type(self).__name__, self._loss
        params = _signatures.options(loss)
        unknown = set(options) - {p.name for p in params}
        if unknown:
            raise TypeError(f"{what}() got an unexpected keyword argument '{sorted(unknown)[0]}'")
        for p in params:
            value = options.get(p.name, p.default)
            setattr(self, p.name, _signatures.cast(p)(value, what))

    def _options(self) -> Dict[str, Any]:
        return {p.name: getattr(self, p.name) for p in _signatures.options(self._loss)}

    def _call(self, *tensors, **more):
        """The loss of ``tensors`` with this Module's options (``more`` replaces some)."""
        return getattr(sys.modules[__package__], self._loss.name)(*tensors, **{**self._options(), **more})

    def _scale_and_bias(self, like: torch.Tensor):
        """The scale's log and the bias the Module owns, in ``like``'s dtype."""
        return self.logit_scale.to(like.dtype), None if self.logit_bias is None else self.logit_bias.to(like.dtype)

    def extra_repr(self) -> str:
        """What ``print(module)`` shows: the scale and bias it owns, and the options but the group."""
        scale = (f"scale={self.logit_scale.detach().exp().item():.4g}, bias={self.logit_bias is not None}, "
                 if getattr(self, "logit_scale", None) is not None else "")
        return scale + ", ".join(f"{k}={v!r}" for k, v in self._options().items() if k != "group")


class _FeatureLoss(_LossModule):
    """The Modules of the losses over one feature vector per row (every loss but
    late interaction's): their shared options, normalize and the Matryoshka
    prefixes (the memory path is every loss's)."""


class ClipLoss(_FeatureLoss, loss="clip_loss"):
    """Module form of ``contrax.clip_loss`` that owns the learnable scale.

    Args:
        init_scale: the initial scale ``exp(logit_scale)`` (CLIP: ``1 / 0.07``);
            the parameter ``logit_scale`` holds its log.
        learn_scale: False keeps the scale fixed (a buffer, not a parameter).
        init_bias: if given, a learnable logit bias with this initial value.
        tiled: ``path="tiled"`` (no labels, mean reduction).

    Labels are passed to ``forward``.
    """

    logit_scale: torch.Tensor  # a Parameter, or a buffer when not learnt
    logit_bias: Optional[torch.nn.Parameter]
    tiled: bool

    def __init__(self, *, init_scale: float = 1.0 / 0.07, learn_scale: bool = True,
                 init_bias: Optional[float] = None, tiled: bool = False, **options):
        super().__init__(options)
        _register_scale_and_bias(self, init_scale, learn_scale, init_bias, "ClipLoss")
        self.tiled = bool(tiled)
        if self.tiled and self.reduction != "mean":
            raise ValueError(f"ClipLoss(): argument 'reduction' must be \"mean\" with tiled=True, "
                             f"but got {self.reduction!r}")

    def scale(self) -> torch.Tensor:
        """The scale the logits are multiplied by: ``min(exp(logit_scale), max_logit_scale)``."""
        return self.logit_scale.detach().exp().clamp(max=self.max_logit_scale)

    def forward(self, a: torch.Tensor, b: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss of paired rows ``a``, ``b`` (``[b_r, d]``) with this Module's scale and bias;
        ``labels`` (int64 ``[b_r]``, optional) as in ``contrax.clip_loss``."""
        if self.tiled and labels is not None:
            raise ValueError("ClipLoss.forward(): argument 'labels' is not supported with tiled=True "
                             "(use contrax.grouped_loss with tile_size for labelled tiled losses)")
        return self._call(a, b, *self._scale_and_bias(a), labels=labels, **({"path": "tiled"} if self.tiled else {}))


class _TemperatureLoss(_FeatureLoss):
    """The Modules of NT-Xent and MoCo v3: their options, the temperature > 0."""

    def __init__(self, **options):
        super().__init__(options)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"{type(self).__name__}(): argument 'temperature' must be > 0, "
                             f"but got {self.temperature!r}")


class NTXentLoss(_TemperatureLoss, loss="nt_xent_loss"):
    """Module form of ``contrax.nt_xent_loss`` (SimCLR)."""

    def forward(self, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
        """NT-Xent of the two views' projections ``z1``, ``z2`` (``[b_r, d]``)."""
        return self._call(z1, z2)


class MoCoV3Loss(_TemperatureLoss, loss="moco_v3_loss"):
    """Module form of ``contrax.moco_v3_loss``."""

    def forward(self, q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
        """MoCo v3's symmetrised loss of queries ``q1``, ``q2`` and keys ``k1``, ``k2``."""
        return self._call(q1, q2, k1, k2)


class SigLIPLoss(_FeatureLoss, loss="siglip_loss"):
    """Module form of ``contrax.siglip_loss`` that owns the scale and the bias.

    Args:
        init_scale: initial ``exp(logit_scale)`` (SigLIP: 10).
        init_bias: initial bias (SigLIP: -10); None for no bias.
    """

    logit_scale: torch.nn.Parameter
    logit_bias: Optional[torch.nn.Parameter]

    def __init__(self, *, init_scale: float = 10.0, init_bias: Optional[float] = -10.0, **options):
        super().__init__(options)
        _register_scale_and_bias(self, init_scale, True, init_bias, "SigLIPLoss")

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The sigmoid loss of paired rows ``a``, ``b`` with this Module's scale and bias."""
        return self._call(a, b, *self._scale_and_bias(a))


class GroupedLoss(_FeatureLoss, loss="grouped_loss"):
    """Module form of ``contrax.grouped_loss`` (queries against grouped candidates:
    each query's positive and hard negatives, every rank's candidates negatives of
    every query) that owns the learnable scale.

    Args:
        init_scale: initial ``exp(logit_scale)`` (e.g. ``1 / 0.05``); the parameter
            ``logit_scale`` holds its log.
        learn_scale: False keeps the scale fixed (a buffer).
        init_bias: if given, a learnable logit bias with this initial value.

    Labels are passed to ``forward``.
    """

    logit_scale: torch.Tensor  # a Parameter, or a buffer when not learnt
    logit_bias: Optional[torch.nn.Parameter]

    def __init__(self, *, init_scale: float = 1.0 / 0.07, learn_scale: bool = True,
                 init_bias: Optional[float] = None, **options):
        super().__init__(options)
        _register_scale_and_bias(self, init_scale, learn_scale, init_bias, "GroupedLoss")

    def forward(self, queries: torch.Tensor, candidates: torch.Tensor, labels: Optional[torch.Tensor] = None,
                candidate_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss of ``queries`` (``[b_r, d]``) against ``candidates`` (``[b_r * g, d]``, per query its
        positive then ``g - 1`` hard negatives); optional int64 ids as in ``contrax.grouped_loss``."""
        return self._call(queries, candidates, *self._scale_and_bias(queries), labels=labels,
                          candidate_labels=candidate_labels)


class MaxSimLoss(_LossModule, loss="maxsim_loss"):
    """Module form of ``contrax.maxsim_loss`` (late interaction: ColBERT, ColPali,
    PyLate).

    Args:
        init_scale: if given, a learnable scale with this initial value
            (``exp(logit_scale)``); None (default): the fixed ``temperature``
            option divides the scores, as PyLate's and colpali-engine's losses do.

    Masks are passed to ``forward``.
    """

    logit_scale: Optional[torch.nn.Parameter]
    logit_bias: None

    def __init__(self, *, init_scale: Optional[float] = None, **options):
        super().__init__(options)
        if init_scale is None:
            self.logit_scale, self.logit_bias = None, None
        else:
            _register_scale_and_bias(self, init_scale, True, None, "MaxSimLoss")

    def forward(self, queries: torch.Tensor, documents: torch.Tensor, query_mask: Optional[torch.Tensor] = None,
                document_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss of query tokens ``[b_r, Lq, d]`` against documents ``[b_r * g, Ld, d]`` (per query its
        positive, then ``g - 1`` hard negatives); optional bool masks of the valid tokens."""
        scale = None if self.logit_scale is None else self.logit_scale.to(queries.dtype)
        return self._call(queries, documents, scale, query_mask=query_mask, document_mask=document_mask)
