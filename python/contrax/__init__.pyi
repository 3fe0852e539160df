# Type stub for the contrax package (Python binding of the Contrax C++ library).
from typing import Any, Callable, Dict, List, Literal, Optional, Protocol, Sequence, Tuple, Union, overload

import torch
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import deprecated

__version__: str

class _Local: ...

LOCAL: _Local

class Communicator:
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def backend(self) -> str: ...
    static_shapes: bool
    def stats(self) -> Dict[str, Dict[str, int]]: ...
    def reset_stats(self) -> None: ...

def communicator(group: Optional[ProcessGroup] = ...) -> Communicator: ...
def clear_cache() -> None: ...
def set_keep_loss_workspace(keep: bool) -> None: ...
def loss_workspace_bytes() -> int: ...
def release_loss_workspace() -> None: ...

# The losses and the deprecated always-tiled entry points, as python/contrax/_signatures.py declares
# them (`python -m contrax._signatures` prints this block; python/tests/test_signatures.py
# checks it).
def clip_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor, logit_bias: Optional[torch.Tensor] = ...,
    *, symmetric: bool = ..., max_logit_scale: float = ..., normalize: bool = ...,
    labels: Optional[torch.Tensor] = ..., label_mode: Literal["multi_positive", "mask_duplicates"] = ...,
    reduction: Literal["mean", "sum", "none"] = ..., path: Literal["auto", "materialised", "tiled"] = ...,
    tile_size: int = ..., ring: bool = ..., group: Optional[ProcessGroup] = ...) -> torch.Tensor: ...

def grouped_loss(queries: torch.Tensor, candidates: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: Optional[torch.Tensor] = ..., *, labels: Optional[torch.Tensor] = ...,
    candidate_labels: Optional[torch.Tensor] = ..., label_mode: Literal["multi_positive", "mask_duplicates"] = ...,
    reduction: Literal["mean", "sum", "none"] = ..., max_logit_scale: float = ..., normalize: bool = ...,
    path: Literal["auto", "materialised", "tiled"] = ..., tile_size: int = ..., ring: bool = ...,
    group: Optional[ProcessGroup] = ...) -> torch.Tensor: ...

def nt_xent_loss(z1: torch.Tensor, z2: torch.Tensor, *, temperature: float = ..., normalize: bool = ...,
    reduction: Literal["mean", "sum", "none"] = ..., path: Literal["auto", "materialised", "tiled"] = ...,
    tile_size: int = ..., ring: bool = ..., group: Optional[ProcessGroup] = ...) -> torch.Tensor: ...

def moco_v3_loss(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, *,
    temperature: float = ..., normalize: bool = ..., reduction: Literal["mean", "sum", "none"] = ...,
    path: Literal["auto", "materialised", "tiled"] = ..., tile_size: int = ..., ring: bool = ...,
    group: Optional[ProcessGroup] = ...) -> torch.Tensor: ...

def siglip_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: Optional[torch.Tensor] = ..., *, max_logit_scale: float = ..., normalize: bool = ...,
    path: Literal["auto", "materialised", "tiled"] = ..., tile_size: int = ..., ring: bool = ...,
    group: Optional[ProcessGroup] = ...) -> torch.Tensor: ...

@deprecated("contrax.tiled_clip_loss is deprecated; use contrax.clip_loss(..., path='tiled')")
def tiled_clip_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: Optional[torch.Tensor] = ..., *, symmetric: bool = ..., max_logit_scale: float = ...,
    normalize: bool = ..., tile_size: int = ..., ring: bool = ...,
    group: Optional[ProcessGroup] = ...) -> torch.Tensor: ...

@deprecated("contrax.tiled_nt_xent_loss is deprecated; use contrax.nt_xent_loss(..., path='tiled')")
def tiled_nt_xent_loss(z1: torch.Tensor, z2: torch.Tensor, *, temperature: float = ..., normalize: bool = ...,
    tile_size: int = ..., ring: bool = ..., group: Optional[ProcessGroup] = ...) -> torch.Tensor: ...

@deprecated("contrax.tiled_moco_v3_loss is deprecated; use contrax.moco_v3_loss(..., path='tiled')")
def tiled_moco_v3_loss(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, *,
    temperature: float = ..., normalize: bool = ..., tile_size: int = ..., ring: bool = ...,
    group: Optional[ProcessGroup] = ...) -> torch.Tensor: ...

class _Gather(Protocol):
    """gather_with_grad and gather_no_grad: the rows, or with return_counts (all, counts, offset)."""
    @overload
    def __call__(self, x: torch.Tensor, group: Optional[ProcessGroup] = ..., *,
                 return_counts: Literal[False] = ...) -> torch.Tensor: ...
    @overload
    def __call__(self, x: torch.Tensor, group: Optional[ProcessGroup] = ..., *,
                 return_counts: Literal[True]) -> Tuple[torch.Tensor, List[int], int]: ...

gather_with_grad: _Gather
gather_no_grad: _Gather

def grad_cache_inject(rep: torch.Tensor, grad: torch.Tensor) -> torch.Tensor: ...
def momentum_schedule(base: float, step: int, total_steps: int) -> float: ...
def momentum_update(target: torch.nn.Module, online: torch.nn.Module, momentum: float) -> None: ...

# Gradient cache (contrax/grad_cache.py).
class GradCacheEncoder:
    encoder: Callable[..., Any]
    chunk_size: int
    get_rep: Optional[Callable[[Any], torch.Tensor]]
    split: Optional[Callable[[Any, int], Sequence[Any]]]
    name: Optional[str]
    ddp: Optional[DistributedDataParallel]
    def __init__(
        self,
        encoder: Callable[..., Any],
        chunk_size: int,
        *,
        get_rep: Optional[Callable[[Any], torch.Tensor]] = ...,
        split: Optional[Callable[[Any, int], Sequence[Any]]] = ...,
        name: Optional[str] = ...,
        ddp: Optional[DistributedDataParallel] = ...,
    ) -> None: ...

class GradCache:
    encoders: List[GradCacheEncoder]
    loss_fn: Optional[Callable[..., torch.Tensor]]
    scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]]
    bf16_autocast: bool
    replay_rng: bool
    def __init__(
        self,
        encoders: Sequence[Union[GradCacheEncoder, Callable[..., Any]]],
        loss_fn: Optional[Callable[..., torch.Tensor]] = ...,
        *,
        chunk_size: Optional[int] = ...,
        scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = ...,
        bf16_autocast: bool = ...,
        replay_rng: bool = ...,
    ) -> None: ...
    def cache(self, encoder: Union[int, str], inputs: Any) -> Optional[torch.Tensor]: ...
    def finish(self, loss_fn: Optional[Callable[..., torch.Tensor]] = ...) -> torch.Tensor: ...
    def finish_deferred(self, loss_fn: Optional[Callable[..., torch.Tensor]] = ...) -> torch.Tensor: ...
    def step(self, *inputs: Any) -> torch.Tensor: ...
    def __call__(self, *inputs: Any) -> torch.Tensor: ...
    def cached_rows(self, encoder: Union[int, str]) -> int: ...
    def clear(self) -> None: ...

# The loss Modules: their options are the loss's (contrax/_signatures.py; test_signatures.py checks these).
class _LossModule(torch.nn.Module):
    normalize: bool
    path: str
    tile_size: int
    ring: bool

class ClipLoss(_LossModule):
    logit_scale: torch.Tensor
    logit_bias: Optional[torch.nn.Parameter]
    symmetric: bool
    max_logit_scale: float
    label_mode: str
    reduction: str
    tiled: bool
    def __init__(self, *, init_scale: float = ..., learn_scale: bool = ..., init_bias: Optional[float] = ...,
                 tiled: bool = ..., symmetric: bool = ..., max_logit_scale: float = ..., normalize: bool = ...,
                 label_mode: Literal["multi_positive", "mask_duplicates"] = ...,
                 reduction: Literal["mean", "sum", "none"] = ..., path: Literal["auto", "materialised", "tiled"] = ...,
                 tile_size: int = ..., ring: bool = ..., group: Optional[ProcessGroup] = ...) -> None: ...
    def scale(self) -> torch.Tensor: ...
    def forward(self, a: torch.Tensor, b: torch.Tensor, labels: Optional[torch.Tensor] = ...) -> torch.Tensor: ...

class _TemperatureLoss(_LossModule):
    temperature: float
    reduction: str

class NTXentLoss(_TemperatureLoss):
    def __init__(self, *, temperature: float = ..., normalize: bool = ...,
                 reduction: Literal["mean", "sum", "none"] = ..., path: Literal["auto", "materialised", "tiled"] = ...,
                 tile_size: int = ..., ring: bool = ..., group: Optional[ProcessGroup] = ...) -> None: ...
    def forward(self, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor: ...

class MoCoV3Loss(_TemperatureLoss):
    def __init__(self, *, temperature: float = ..., normalize: bool = ...,
                 reduction: Literal["mean", "sum", "none"] = ..., path: Literal["auto", "materialised", "tiled"] = ...,
                 tile_size: int = ..., ring: bool = ..., group: Optional[ProcessGroup] = ...) -> None: ...
    def forward(self, q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor: ...

class SigLIPLoss(_LossModule):
    logit_scale: torch.nn.Parameter
    logit_bias: Optional[torch.nn.Parameter]
    max_logit_scale: float
    def __init__(self, *, init_scale: float = ..., init_bias: Optional[float] = ..., max_logit_scale: float = ...,
                 normalize: bool = ..., path: Literal["auto", "materialised", "tiled"] = ..., tile_size: int = ...,
                 ring: bool = ..., group: Optional[ProcessGroup] = ...) -> None: ...
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...

class GroupedLoss(_LossModule):
    logit_scale: torch.Tensor
    logit_bias: Optional[torch.nn.Parameter]
    label_mode: str
    reduction: str
    max_logit_scale: float
    def __init__(self, *, init_scale: float = ..., learn_scale: bool = ..., init_bias: Optional[float] = ...,
                 label_mode: Literal["multi_positive", "mask_duplicates"] = ...,
                 reduction: Literal["mean", "sum", "none"] = ..., max_logit_scale: float = ..., normalize: bool = ...,
                 path: Literal["auto", "materialised", "tiled"] = ..., tile_size: int = ..., ring: bool = ...,
                 group: Optional[ProcessGroup] = ...) -> None: ...
    def forward(self, queries: torch.Tensor, candidates: torch.Tensor, labels: Optional[torch.Tensor] = ...,
                candidate_labels: Optional[torch.Tensor] = ...) -> torch.Tensor: ...
