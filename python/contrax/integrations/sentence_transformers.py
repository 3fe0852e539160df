"""sentence-transformers' ``MultipleNegativesRankingLoss`` and
``CachedMultipleNegativesRankingLoss`` computed exactly by Contrax, for
``SentenceTransformerTrainer``, and its ``MatryoshkaLoss`` around either.

The swap::

    from sentence_transformers.sentence_transformer import losses            # before
    from contrax.integrations import sentence_transformers as losses         # after

    loss = losses.MultipleNegativesRankingLoss(model, gather_across_devices=True)
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=32, gather_across_devices=True)
    loss = losses.MatryoshkaLoss(model, loss, [768, 512, 256, 128, 64])          # around either of the two

Same arguments and the same ``forward(sentence_features, labels)``; the
Trainer needs nothing else. Columns: anchor, positive, then any number of
hard-negative columns. Anchor i's candidates are every positive and every hard
negative of the (gathered) batch; its loss is ``lse_i - scale * sim(a_i, p_i)``,
with ``sim`` the cosine (``cos_sim``, the default) or the dot product
(``dot_score``).

What changes underneath (docs/integrations.md says more, and what is tested):
the loss is Contrax's grouped loss, exact across ranks also when the batches
are uneven (sentence-transformers' ``offset = rank * batch_size`` assumes even
ones); a candidate with the same tokens as the anchor's positive, other than
that positive, leaves the anchor's softmax (``mask_duplicates=True``, the
default; sentence-transformers leaves this to its ``no_duplicates`` batch
sampler, with which the losses are identical); the cached variant is
``contrax.GradCache`` (see ``CachedMultipleNegativesRankingLoss``).

Only the default interaction (``directions=("query_to_doc",)``) is
provided, and no hardness weighting; other settings are refused with the
reason. Contrax-only keyword arguments: ``mask_duplicates``, ``path`` /
``tile_size`` / ``ring`` (the memory path) and ``group``.

``MatryoshkaLoss`` (see the class) passes its widths and weights to the
wrapped loss's one ``contrax.grouped_loss`` call (``matryoshka_dims`` /
``matryoshka_weights``): one gather and, for the cached loss, one
gradient-cache pass serve every prefix. Random subsets of the widths
(``n_dims_per_step``) and losses other than the two above are refused.
"""
import hashlib
import logging
import math
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import grouped_loss
from ..grad_cache import GradCache, GradCacheEncoder
from ._groups import distributed_group, set_memory_path

__all__ = ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss", "MatryoshkaLoss"]

logger = logging.getLogger(__name__)


def _cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity matrix (the default when sentence-transformers is absent)."""
    return torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).transpose(0, 1)


def _default_similarity():
    try:
        from sentence_transformers.util import cos_sim
        return cos_sim
    except ImportError:
        return _cos_sim


def _normalize_for(similarity_fct, where: str) -> bool:
    """Contrax computes Gram matrices: cosine (normalise inside) or dot product."""
    name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
    if name in ("cos_sim", "_cos_sim", "pairwise_cos_sim"):
        return True
    if name in ("dot_score", "pairwise_dot_score"):
        return False
    raise ValueError(f"{where}: argument 'similarity_fct' must be sentence_transformers.util.cos_sim or dot_score "
                     f"(Contrax computes cosine or dot-product logits), but got {name}")


def text_ids(features: Mapping) -> Optional[torch.Tensor]:
    """One int64 id per row of a tokenised column: a hash of the row's tokens
    without padding, so equal texts get equal ids in any column and on any
    rank (None when the column has no ``input_ids``)."""
    ids = features.get("input_ids") if isinstance(features, Mapping) else None
    if not torch.is_tensor(ids) or ids.dim() != 2:
        return None
    mask = features.get("attention_mask")
    rows = ids.to(torch.int64).cpu().numpy()
    keep = mask.bool().cpu().numpy() if torch.is_tensor(mask) and mask.shape == ids.shape else None
    out = []
    for r in range(rows.shape[0]):
        tokens = rows[r][keep[r]] if keep is not None else rows[r]
        digest = hashlib.blake2b(tokens.tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(out, dtype=torch.int64, device=ids.device)


def _embed_columns(model, features: List[Dict[str, Any]]) -> List[torch.Tensor]:
    """sentence-transformers' own column embedding (one merged forward for the
    candidate columns where it can), so that the embeddings are the ones its
    loss sees; one forward per column without it."""
    try:
        from sentence_transformers.base.losses.merged_forward import embed_columns
    except ImportError:
        return [model(f)["sentence_embedding"] for f in features]
    return embed_columns(model, features)


class _GroupedRanking:
    """The loss both classes compute from the embeddings of the columns."""

    # (dims, weights) while a MatryoshkaLoss calls this loss: its prefixes.
    _matryoshka = None

    def _prefix_arguments(self, width: int, where: str) -> Dict[str, Any]:
        """grouped_loss's matryoshka_dims / matryoshka_weights for features
        ``width`` wide: a width listed twice once with the sum of its weights,
        and the full width, which Contrax always scores, with weight 0 when
        it is not listed (sentence-transformers then leaves it out)."""
        if self._matryoshka is None:
            return {}
        merged: Dict[int, float] = {}
        for dim, weight in zip(*self._matryoshka):
            if dim > width:
                raise ValueError(f"{where}: MatryoshkaLoss's 'matryoshka_dims' must hold widths in [1, {width}] "
                                 f"(the embeddings' width), but got {dim}")
            merged[dim] = merged.get(dim, 0.0) + float(weight)
        merged.setdefault(width, 0.0)
        return {"matryoshka_dims": list(merged), "matryoshka_weights": list(merged.values())}

    def _setup(self, where, scale, similarity_fct, gather_across_devices, directions, partition_mode,
               hardness_mode, hardness_strength, mask_duplicates, path, tile_size, ring, group):
        similarity_fct = _default_similarity() if similarity_fct is None else similarity_fct
        if not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(f"{where}: argument 'scale' must be a positive number, but got {scale!r}")
        if tuple(directions) != ("query_to_doc",):
            raise ValueError(f"{where}: argument 'directions' must be ('query_to_doc',), but got "
                             f"{tuple(directions)!r}: Contrax provides the standard anchor-to-candidates loss (use "
                             "sentence-transformers' own loss for the symmetric and same-type terms)")
        if partition_mode not in ("joint", "per_direction"):
            raise ValueError(f"{where}: argument 'partition_mode' must be 'joint' or 'per_direction', "
                             f"but got {partition_mode!r}")
        if hardness_mode is not None and hardness_strength != 0.0:
            raise ValueError(f"{where}: argument 'hardness_mode' must be None (or 'hardness_strength' 0), but "
                             f"got {hardness_mode!r} with strength {hardness_strength}: hardness weighting is not "
                             "provided")
        self.scale = float(scale)
        self.similarity_fct = similarity_fct
        self._normalize = _normalize_for(similarity_fct, where)
        self.gather_across_devices = bool(gather_across_devices)
        self.directions = tuple(directions)
        self.partition_mode = partition_mode
        self.hardness_mode = hardness_mode
        self.hardness_strength = float(hardness_strength)
        self.mask_duplicates = bool(mask_duplicates)
        set_memory_path(self, path, tile_size, ring, group)

    def _ids(self, features):
        if not self.mask_duplicates:
            return None
        ids = [text_ids(f) for f in features]
        return None if any(i is None for i in ids) else ids

    def compute_loss_from_embeddings(self, embeddings: List[torch.Tensor], labels=None,
                                     ids: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """The loss of the columns' embeddings ``[anchor, positive, negative_1, ...]``
        (``[b_r, d]`` each); ``ids`` (one int64 ``[b_r]`` per column, equal for
        equal texts) mask the duplicates of each anchor's positive."""
        where = f"{type(self).__name__}.forward()"
        if len(embeddings) < 2:
            raise ValueError(f"{where}: expected at least 2 columns (anchor, positive, ...), got {len(embeddings)}")
        queries, docs = embeddings[0], embeddings[1:]
        # [b, g, d] -> [b * g, d]: each anchor's positive, then its hard negatives.
        candidates = torch.stack(docs, dim=1).reshape(-1, queries.shape[-1])
        labels_q = candidate_labels = None
        if ids is not None:
            labels_q = ids[1]
            candidate_labels = torch.stack(ids[1:], dim=1).reshape(-1)
        log_scale = torch.tensor(self.scale, dtype=queries.dtype, device=queries.device).log()
        # With Matryoshka prefixes Contrax normalises every prefix whatever
        # `normalize` says, as sentence-transformers' MatryoshkaLoss does.
        return grouped_loss(queries, candidates, log_scale, labels=labels_q, candidate_labels=candidate_labels,
                            label_mode="mask_duplicates", max_logit_scale=float(torch.finfo(queries.dtype).max),
                            normalize=self._normalize, path=self.path, tile_size=self.tile_size, ring=self.ring,
                            group=distributed_group(self.gather_across_devices, self.group, where),
                            **self._prefix_arguments(queries.shape[-1], where))

    def get_config_dict(self) -> Dict[str, Any]:
        """The hyperparameters for the model card."""
        return {"scale": self.scale, "similarity_fct": getattr(self.similarity_fct, "__name__", "?"),
                "gather_across_devices": self.gather_across_devices, "directions": self.directions,
                "partition_mode": self.partition_mode, "mask_duplicates": self.mask_duplicates}

    @property
    def temperature(self) -> float:
        """``1 / scale``."""
        return 1.0 / self.scale


class MultipleNegativesRankingLoss(_GroupedRanking, torch.nn.Module):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` (InfoNCE with
    in-batch and hard negatives), exact across ranks.

    Arguments of sentence_transformers:
        model: the SentenceTransformer (the Trainer swaps in its DDP wrapper).
        scale: logits are ``scale * sim`` (``1 / temperature``; default 20).
        similarity_fct: ``cos_sim`` (default) or ``dot_score``.
        gather_across_devices: candidates from every rank (True) or this rank's alone.
        directions, partition_mode, hardness_mode, hardness_strength: only the
            defaults (see the module docstring).

    Contrax keyword arguments:
        mask_duplicates: leave candidates with the anchor's positive's text out
            of its softmax (default True).
        path, tile_size, ring: the memory path of ``contrax.grouped_loss``.
        group: the ``torch.distributed`` ProcessGroup to span instead of the default one.
    """

    def __init__(self, model, scale: float = 20.0, similarity_fct=None, gather_across_devices: bool = False,
                 directions=("query_to_doc",), partition_mode: str = "joint", hardness_mode=None,
                 hardness_strength: float = 0.0, *, mask_duplicates: bool = True, path: str = "auto",
                 tile_size: int = 0, ring: bool = False, group=None):
        torch.nn.Module.__init__(self)
        self.model = model
        self._setup("MultipleNegativesRankingLoss()", scale, similarity_fct, gather_across_devices, directions,
                    partition_mode, hardness_mode, hardness_strength, mask_duplicates, path, tile_size, ring, group)

    def forward(self, sentence_features: Iterable[Dict[str, torch.Tensor]], labels=None) -> torch.Tensor:
        """The loss of one batch of tokenised columns (anchor, positive, negatives...)."""
        features = list(sentence_features)
        return self.compute_loss_from_embeddings(_embed_columns(self.model, features), labels, self._ids(features))

    @property
    def citation(self) -> str:
        """BibTeX of the paper the loss comes from (Henderson et al. 2017), for the model card."""
        return ("@misc{henderson2017efficient, title={Efficient Natural Language Response Suggestion for Smart "
                "Reply}, author={Matthew Henderson and others}, year={2017}, eprint={1705.00652}, "
                "archivePrefix={arXiv}}")


def _rows(features: Mapping) -> int:
    for key in ("input_ids", "attention_mask"):
        if torch.is_tensor(features.get(key)):
            return features[key].shape[0]
    return next(v.shape[0] for v in features.values() if torch.is_tensor(v) and v.dim() > 0)


def _split_features(features: Mapping, chunk_size: int):
    """Mini-batches of a tokenised column: tensors sliced along the batch, the
    padding that every row of a mini-batch shares dropped; each wrapped as a
    1-tuple so that GradCache passes it to the model as one argument."""
    rows = _rows(features)
    mask = features.get("attention_mask")
    pieces = []
    for start in range(0, max(rows, 1), chunk_size):
        stop = min(start + chunk_size, rows)
        width = None
        if torch.is_tensor(mask) and mask.dim() == 2 and stop > start:
            used = mask[start:stop].any(dim=0).nonzero()
            width = int(used.max()) + 1 if used.numel() else mask.shape[1]
        piece = {}
        for k, v in features.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows:
                v = v[start:stop]
                if width is not None and v.dim() == 2 and v.shape[1] == mask.shape[1]:
                    v = v[:, :width]
            piece[k] = v
        pieces.append((piece,))
    return pieces


class CachedMultipleNegativesRankingLoss(_GroupedRanking, torch.nn.Module):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` on Contrax's
    GradCache: the loss of ``MultipleNegativesRankingLoss`` with the activation
    memory of one mini-batch, and one DDP gradient synchronisation per step.

    Args as ``MultipleNegativesRankingLoss``, plus:
        mini_batch_size: rows per embedding mini-batch (default 32).
        mini_batch_num_tokens: must be None (token-count packing is not provided).
        show_progress_bar: accepted; nothing to show.

    The forward embeds every column in mini-batches without a graph, computes
    the loss and its gradient with respect to every embedding, and returns the
    loss; the Trainer's ``backward()`` on it re-embeds the mini-batches (same
    random state, so the same dropout masks) and backpropagates. Under
    ``torch.no_grad()`` (evaluation) it only computes the loss.

    With DDP, every rank re-embeds its own mini-batches; when ranks hold
    different numbers of rows and so different numbers of mini-batches, DDP's
    buffer broadcast before each forward needs ``ddp_broadcast_buffers=False``
    (the Trainer's argument; transformer models' buffers are constants).
    """

    def __init__(self, model, scale: float = 20.0, similarity_fct=None, mini_batch_size: int = 32,
                 mini_batch_num_tokens: Optional[int] = None, gather_across_devices: bool = False,
                 directions=("query_to_doc",), partition_mode: str = "joint", show_progress_bar: bool = False,
                 hardness_mode=None, hardness_strength: float = 0.0, *, mask_duplicates: bool = True,
                 path: str = "auto", tile_size: int = 0, ring: bool = False, group=None):
        torch.nn.Module.__init__(self)
        where = "CachedMultipleNegativesRankingLoss()"
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size <= 0:
            raise ValueError(f"{where}: argument 'mini_batch_size' must be a positive integer, "
                             f"but got {mini_batch_size!r}")
        if mini_batch_num_tokens is not None:
            raise ValueError(f"{where}: argument 'mini_batch_num_tokens' must be None: mini-batches are counted "
                             "in rows (mini_batch_size)")
        self.model = model
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = None
        self.show_progress_bar = bool(show_progress_bar)
        self._setup(where, scale, similarity_fct, gather_across_devices, directions, partition_mode, hardness_mode,
                    hardness_strength, mask_duplicates, path, tile_size, ring, group)

    def _encoder(self, column: int) -> GradCacheEncoder:
        model = self.model
        ddp = model if isinstance(model, DistributedDataParallel) else None
        # A fresh dict per call: sentence-transformers' modules write their
        # outputs into the features they are given.
        return GradCacheEncoder(lambda piece: model(dict(piece))["sentence_embedding"], self.mini_batch_size,
                                split=_split_features, name=f"column {column}", ddp=ddp)

    def forward(self, sentence_features: Iterable[Dict[str, torch.Tensor]], labels=None) -> torch.Tensor:
        """The loss of one batch; its backward runs GradCache's second pass."""
        features = list(sentence_features)
        if len(features) < 2:
            raise ValueError(f"{type(self).__name__}.forward(): expected at least 2 columns (anchor, positive, "
                             f"...), got {len(features)}")
        ids = self._ids(features)
        if not torch.is_grad_enabled():
            reps = [torch.cat([self.model(dict(p[0]))["sentence_embedding"]
                               for p in _split_features(f, self.mini_batch_size)]) for f in features]
            return self.compute_loss_from_embeddings(reps, labels, ids)
        cache = GradCache([self._encoder(c) for c in range(len(features))])
        for c, f in enumerate(features):
            cache.cache(c, f)
        return cache.finish_deferred(lambda *reps: self.compute_loss_from_embeddings(list(reps), labels, ids))

    def get_config_dict(self) -> Dict[str, Any]:
        """The hyperparameters for the model card."""
        return {**super().get_config_dict(), "mini_batch_size": self.mini_batch_size}

    @property
    def citation(self) -> str:
        """BibTeX of the gradient-cache paper (Gao et al. 2021), for the model card."""
        return ("@misc{gao2021scaling, title={Scaling Deep Contrastive Learning Batch Size under Memory Limited "
                "Setup}, author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan}, year={2021}, "
                "eprint={2101.06983}, archivePrefix={arXiv}}")


def _embedding_dimension(model) -> Optional[int]:
    """The model's embedding width, or None where it does not say."""
    for name in ("get_embedding_dimension", "get_sentence_embedding_dimension"):
        method = getattr(model, name, None)
        if callable(method):
            return method()
    return None


class MatryoshkaLoss(torch.nn.Module):
    """sentence-transformers' ``MatryoshkaLoss`` around Contrax's
    ``MultipleNegativesRankingLoss`` or ``CachedMultipleNegativesRankingLoss``:
    ``sum_p w_p * loss(embeddings[:, :m_p], each row L2-normalised)`` over the
    widths ``m_p`` of ``matryoshka_dims``.

    The wrapped loss computes every prefix in its one ``contrax.grouped_loss``
    call (``matryoshka_dims`` / ``matryoshka_weights``): the embeddings are
    computed and gathered once, and the cached loss runs one gradient-cache
    pass (each mini-batch embedded twice) whatever the number of prefixes.
    Each prefix is normalised before its similarities, with ``cos_sim`` and
    with ``dot_score`` alike (so ``dot_score`` scores prefixes by their cosine,
    as sentence-transformers' does).

    Arguments of sentence_transformers:
        model: the SentenceTransformer (the Trainer swaps in its DDP wrapper).
        loss: Contrax's ``MultipleNegativesRankingLoss`` or
            ``CachedMultipleNegativesRankingLoss`` (anything else is refused).
        matryoshka_dims: the widths, any order, each in ``[1, d]``; the full
            width ``d`` is trained only when listed (a warning says so).
        matryoshka_weights: one weight per width (default 1 each).
        n_dims_per_step: must select every width (-1, the default, or at least
            ``len(matryoshka_dims)``): a random subset per step is refused.
    """

    def __init__(self, model, loss, matryoshka_dims: Sequence[int],
                 matryoshka_weights: Optional[Sequence[float]] = None, n_dims_per_step: int = -1):
        super().__init__()
        where = "MatryoshkaLoss()"
        if not isinstance(loss, _GroupedRanking):
            raise ValueError(f"{where}: argument 'loss' must be contrax.integrations.sentence_transformers' "
                             "MultipleNegativesRankingLoss or CachedMultipleNegativesRankingLoss (their grouped "
                             f"loss computes the prefixes), but got {type(loss).__module__}.{type(loss).__qualname__}")
        dims = list(matryoshka_dims) if matryoshka_dims is not None else []
        if not dims or any(isinstance(m, bool) or not isinstance(m, int) or m <= 0 for m in dims):
            raise ValueError(f"{where}: argument 'matryoshka_dims' must be a non-empty sequence of positive "
                             f"integers, but got {matryoshka_dims!r}")
        if matryoshka_weights is None:
            weights = [1.0] * len(dims)
        else:
            weights = list(matryoshka_weights)
            if len(weights) != len(dims) or not all(
                    isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
                raise ValueError(f"{where}: argument 'matryoshka_weights' must hold one finite number per entry of "
                                 f"'matryoshka_dims' ({len(dims)}), but got {matryoshka_weights!r}")
        if isinstance(n_dims_per_step, bool) or not isinstance(n_dims_per_step, int) or (
                0 < n_dims_per_step < len(dims)):
            raise ValueError(f"{where}: argument 'n_dims_per_step' must be -1 (every width at every step), but "
                             f"got {n_dims_per_step!r}: a random subset of the {len(dims)} widths per step is not "
                             "provided")
        width = _embedding_dimension(model)
        if width is not None:
            if max(dims) > width:
                raise ValueError(f"{where}: argument 'matryoshka_dims' must hold widths in [1, {width}] (the "
                                 f"model's embedding dimension), but got {max(dims)}")
            if width not in dims:
                logger.warning("MatryoshkaLoss: the model's embedding dimension %d is not in matryoshka_dims %s: "
                               "the full width is not trained", width, dims)
        self.model = model
        self.loss = loss
        # Widest first, as sentence-transformers keeps them (the model card shows them so).
        order = sorted(range(len(dims)), key=lambda i: dims[i], reverse=True)
        self.matryoshka_dims = tuple(dims[i] for i in order)
        self.matryoshka_weights = tuple(weights[i] for i in order)
        self.n_dims_per_step = n_dims_per_step

    def forward(self, sentence_features: Iterable[Dict[str, torch.Tensor]], labels=None) -> torch.Tensor:
        """The wrapped loss of one batch with every prefix (its backward, for
        the cached loss, runs the one gradient-cache second pass)."""
        saved = self.loss._matryoshka
        self.loss._matryoshka = (self.matryoshka_dims, self.matryoshka_weights)
        try:
            return self.loss(sentence_features, labels)
        finally:
            self.loss._matryoshka = saved

    def get_config_dict(self) -> Dict[str, Any]:
        """The hyperparameters for the model card."""
        return {"loss": type(self.loss).__name__, "matryoshka_dims": self.matryoshka_dims,
                "matryoshka_weights": self.matryoshka_weights, "n_dims_per_step": self.n_dims_per_step}

    @property
    def citation(self) -> str:
        """BibTeX of the paper the loss comes from (Kusupati et al., arXiv 2205.13147), for the model card."""
        return ("@misc{kusupati2024matryoshka, title={Matryoshka Representation Learning}, author={Aditya Kusupati "
                "and others}, year={2024}, eprint={2205.13147}, archivePrefix={arXiv}, primaryClass={cs.LG}}")
