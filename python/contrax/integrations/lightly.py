"""lightly's ``NTXentLoss`` (SimCLR) computed exactly by Contrax.

The swap::

    from lightly.loss import NTXentLoss                          # before
    from contrax.integrations.lightly import NTXentLoss          # after

    criterion = NTXentLoss(temperature=0.5, gather_distributed=True)
    loss = criterion(z0, z1)

Same arguments and call. With ``gather_distributed=True`` each rank returns its
share ``L_r = (W/B) sum_{i in r} l_i`` of the mean over all ``2B`` views
(lightly's local mean when batches are even; DDP's averaging then gives the
gradient of one device on the concatenated batch), also when ranks hold
different numbers of rows, which lightly's gather and ``eye_rank`` mask do
not allow; large batches take the tiled or ring path (``path=``,
``tile_size=``, ``ring=``). docs/integrations.md compares it with lightly's.

``memory_bank_size`` must be 0: with a memory bank lightly's loss is MoCo v2's
(negatives from a constant queue, nothing coupling the ranks), which Contrax
does not reimplement. lightly has no MoCo v3 loss; Contrax's is
``contrax.moco_v3_loss``.
"""
import math

import torch

from .. import nt_xent_loss
from ._groups import distributed_group, set_memory_path

__all__ = ["NTXentLoss"]


class NTXentLoss(torch.nn.Module):
    """lightly's ``NTXentLoss(temperature=0.5, memory_bank_size=0, gather_distributed=False)``.

    Arguments of lightly:
        temperature: softmax temperature, > 0.
        memory_bank_size: must be 0 (see the module docstring).
        gather_distributed: negatives from every rank (True) or this rank's alone.

    Contrax keyword arguments:
        path, tile_size, ring: the memory path of ``contrax.nt_xent_loss``.
        group: the ``torch.distributed`` ProcessGroup to span instead of the default one.

    ``forward(out0, out1)``: the two views' projections, ``[b_r, d]`` each
    (normalised inside, as lightly does).
    """

    def __init__(self, temperature: float = 0.5, memory_bank_size=0, gather_distributed: bool = False, *,
                 path: str = "auto", tile_size: int = 0, ring: bool = False, group=None):
        super().__init__()
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"NTXentLoss(): argument 'temperature' must be a finite number > 0, "
                             f"but got {temperature!r}")
        bank = memory_bank_size
        if not (bank == 0 or (isinstance(bank, (tuple, list)) and len(bank) > 0 and bank[0] == 0)):
            raise ValueError(f"NTXentLoss(): argument 'memory_bank_size' must be 0, but got {bank!r}: the memory "
                             "bank (MoCo v2) is lightly's own; use lightly.loss.NTXentLoss for it")
        self.temperature = float(temperature)
        self.memory_bank_size = bank
        self.gather_distributed = bool(gather_distributed)
        set_memory_path(self, path, tile_size, ring, group)

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        """SimCLR's NT-Xent of two views' projections."""
        group = distributed_group(self.gather_distributed, self.group, "NTXentLoss.forward()")
        return nt_xent_loss(out0, out1, temperature=self.temperature, normalize=True, path=self.path,
                            tile_size=self.tile_size, ring=self.ring, group=group)

    def extra_repr(self) -> str:
        """The options shown by ``print(module)``."""
        return f"temperature={self.temperature}, gather_distributed={self.gather_distributed}"
