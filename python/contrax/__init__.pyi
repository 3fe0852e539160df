# Type stub for the contrax package (Python binding of the Contrax C++ library).
from typing import Dict, List, Literal, Optional, Tuple, Union, overload

import torch
from torch.distributed import ProcessGroup

__version__: str

class Communicator:
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def backend(self) -> str: ...
    def stats(self) -> Dict[str, Dict[str, int]]: ...
    def reset_stats(self) -> None: ...

def communicator(group: Optional[ProcessGroup] = ...) -> Communicator: ...
def clear_cache() -> None: ...

def clip_loss(
    a: torch.Tensor,
    b: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: Optional[torch.Tensor] = ...,
    *,
    symmetric: bool = ...,
    max_logit_scale: float = ...,
    normalize: bool = ...,
    group: Optional[ProcessGroup] = ...,
) -> torch.Tensor: ...

def nt_xent_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    *,
    temperature: float = ...,
    normalize: bool = ...,
    group: Optional[ProcessGroup] = ...,
) -> torch.Tensor: ...

def moco_v3_loss(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    *,
    temperature: float = ...,
    normalize: bool = ...,
    group: Optional[ProcessGroup] = ...,
) -> torch.Tensor: ...

@overload
def gather_with_grad(x: torch.Tensor, group: Optional[ProcessGroup] = ..., *,
                     return_counts: Literal[False] = ...) -> torch.Tensor: ...
@overload
def gather_with_grad(x: torch.Tensor, group: Optional[ProcessGroup] = ..., *,
                     return_counts: Literal[True]) -> Tuple[torch.Tensor, List[int], int]: ...
@overload
def gather_no_grad(x: torch.Tensor, group: Optional[ProcessGroup] = ..., *,
                   return_counts: Literal[False] = ...) -> torch.Tensor: ...
@overload
def gather_no_grad(x: torch.Tensor, group: Optional[ProcessGroup] = ..., *,
                   return_counts: Literal[True]) -> Tuple[torch.Tensor, List[int], int]: ...

def momentum_schedule(base: float, step: int, total_steps: int) -> float: ...
def momentum_update(target: torch.nn.Module, online: torch.nn.Module, momentum: float) -> None: ...

# Present when the C++ library has the tiled / ring losses and SigLIP.
def tiled_clip_loss(
    a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor, logit_bias: Optional[torch.Tensor] = ...,
    *, symmetric: bool = ..., max_logit_scale: float = ..., normalize: bool = ..., tile_size: int = ...,
    ring: bool = ..., group: Optional[ProcessGroup] = ...,
) -> torch.Tensor: ...
def tiled_nt_xent_loss(
    z1: torch.Tensor, z2: torch.Tensor, *, temperature: float = ..., normalize: bool = ...,
    tile_size: int = ..., ring: bool = ..., group: Optional[ProcessGroup] = ...,
) -> torch.Tensor: ...
def tiled_moco_v3_loss(
    q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, *, temperature: float = ...,
    normalize: bool = ..., tile_size: int = ..., ring: bool = ..., group: Optional[ProcessGroup] = ...,
) -> torch.Tensor: ...
def siglip_loss(
    a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor, logit_bias: Optional[torch.Tensor] = ...,
    *, max_logit_scale: float = ..., normalize: bool = ..., chunk_size: int = ...,
    group: Optional[ProcessGroup] = ...,
) -> torch.Tensor: ...
