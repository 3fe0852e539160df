"""colpali-engine's late-interaction losses (ColPali, ColQwen: ``colpali_engine.loss``)
computed exactly by Contrax.

The swap::

    from colpali_engine.loss import ColbertLoss                        # before
    from contrax.integrations.colpali_engine import ColbertLoss        # after

    loss_func = ColbertLoss(temperature=0.02, normalize_scores=True)   # unchanged

Same constructor arguments and the same ``forward(query_embeddings,
doc_embeddings[, neg_doc_embeddings], offset=0)`` for ``ColbertLoss``,
``ColbertNegativeCELoss``, ``ColbertPairwiseCELoss``,
``ColbertPairwiseNegativeCELoss`` and ``ColbertSigmoidLoss``. As in
colpali-engine there are no masks: padding is rows of zeros (its models
multiply the embeddings by the attention mask). A zero document row scores 0
against every query token; a zero query row adds 0. ``normalize_scores``
divides each query's score by its count of rows whose first entry is not 0,
colpali-engine's count.

* ``ColbertLoss`` (and the in-batch term of ``ColbertNegativeCELoss``) is
  ``contrax.maxsim_loss``: the token scores of a pair exist only inside panels
  of ``panel_bytes``, never as colpali-engine's ``[queries x documents x Lq x
  Ld]`` einsum. Zero document rows are masked with ``padding_score=0``, which
  is what they score.
* The pairwise and sigmoid losses need every score of a row (the hardest
  in-batch negative, or a term per pair), which ``maxsim_loss`` keeps inside
  itself: they score the ``[b x B]`` matrix by an einsum, as colpali-engine
  does, so their memory is colpali-engine's.
* The explicit negatives' pairwise term, ``softplus((s(q, neg) - s(q, pos)) /
  temperature)`` per query and negative, scores each query against its own
  documents only (``[b, k, Lq, Ld]``, linear in the batch), as colpali-engine does.

Across ranks: the Contrax keyword ``gather_across_devices=True`` gathers every
rank's positives itself (``offset`` stays 0; each rank passes its own rows),
and returns rank r's share of the loss of the concatenated batch, so that
data-parallel averaging gives its gradient exactly: uneven batches, an empty
rank and ranks with different padded lengths included (documents shorter than
the longest of any rank holding rows are padded with zero rows, as
concatenating them would; an empty rank's length counts for nothing). Hard negatives stay with their query, as in colpali-engine. Without
it (the default) the loss is colpali-engine's on the tensors given, including
documents its trainer gathered with ``offset = rank * batch_size``.

Refused, with the reason: ``use_smooth_max=True`` (Contrax's MaxSim takes the
hard maximum) and ``pos_aware_negative_filtering=True`` (it rescales scores
inside the row the loss keeps to itself). ``max_batch_size``, ``tau``,
``norm_tol``, ``filter_threshold`` and ``filter_factor`` are accepted and
choose nothing (there is no index buffer to size, and no bounds warning is
printed). Contrax-only keyword arguments: ``gather_across_devices``,
``panel_bytes`` and ``group``.
"""
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import LOCAL, gather_no_grad, gather_with_grad, maxsim_loss
from ._groups import distributed_group

__all__ = ["ColbertLoss", "ColbertNegativeCELoss", "ColbertPairwiseCELoss", "ColbertPairwiseNegativeCELoss",
           "ColbertSigmoidLoss"]


class _Batch(NamedTuple):
    queries: torch.Tensor  # [b, Lq, d], divided by each query's length with normalize_scores
    docs: torch.Tensor  # [m, Ld, d]: the positives, every rank's ones once gathered
    negatives: Optional[torch.Tensor]  # [b, k, Ln, d]
    offset: int  # query i's positive is docs[offset + i]
    rows: int  # queries in the global batch
    world: int
    group: object


def _pair_scores(queries, docs):
    """MaxSim of query i against its own documents: [b, Lq, d] x [b, k, Ld, d] -> [b, k]."""
    return torch.einsum("bnd,bksd->bkns", queries, docs).amax(-1).sum(-1)


def _all_scores(queries, docs):
    """MaxSim of every query against every document: [b, Lq, d] x [m, Ld, d] -> [b, m]."""
    if docs.requires_grad:
        # The einsum's gradient has strides (Ld, 1, Ld d); torch.distributed.nn.functional.all_gather's
        # backward on Gloo (colpali-engine's trainer gathers the documents with it) sends it as if it
        # were contiguous, which scrambles it.
        docs = docs.view_as(docs)
        docs.register_hook(lambda grad: grad.contiguous())
    return torch.einsum("bnd,msd->bmns", queries, docs).amax(-1).sum(-1)


def _pad_tokens(x, length):
    """[..., L, d] padded with zero rows to `length` tokens (rows that score 0, as padding does)."""
    return x if x is None or x.size(-2) == length else F.pad(x, (0, 0, 0, length - x.size(-2)))


class _Colbert(torch.nn.Module):
    """The arguments colpali-engine's ``ColbertModule`` losses share, checked (the constructor of
    ColbertLoss and ColbertSigmoidLoss), and the batch they see."""

    def __init__(self, temperature: float = 0.02, normalize_scores: bool = True, use_smooth_max: bool = False,
                 pos_aware_negative_filtering: bool = False, max_batch_size: int = 1024, tau: float = 0.1,
                 norm_tol: float = 1e-3, filter_threshold: float = 0.95, filter_factor: float = 0.5, *,
                 gather_across_devices: bool = False, panel_bytes: int = 16 << 20, group=None):
        super().__init__()
        name = type(self).__name__
        if use_smooth_max:
            raise ValueError(f"{name}(): argument 'use_smooth_max' must be False: Contrax's MaxSim takes the hard "
                             "maximum over a document's tokens (colpali-engine's smooth maximum, "
                             "tau * logsumexp(s / tau), is not provided)")
        if pos_aware_negative_filtering:
            raise ValueError(f"{name}(): argument 'pos_aware_negative_filtering' must be False: it scales the "
                             "in-batch negatives scoring above filter_threshold times the positive, inside the "
                             "score row that Contrax's loss never hands out")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"{name}(): argument 'temperature' must be > 0, but got {temperature!r}")
        self.temperature = float(temperature)
        self.normalize_scores = bool(normalize_scores)
        self.use_smooth_max = False
        self.pos_aware_negative_filtering = False
        self.max_batch_size, self.tau, self.norm_tol = max_batch_size, tau, norm_tol
        self.filter_threshold, self.filter_factor = filter_threshold, filter_factor
        self.gather_across_devices = bool(gather_across_devices)
        self.panel_bytes = int(panel_bytes)
        self.group = group

    def forward(self, query_embeddings: torch.Tensor, doc_embeddings: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The in-batch loss (``_in_batch``, each loss's own) of queries ``[b, Lq, d]``
        against documents ``[m, Ld, d]`` (zero rows are padding)."""
        return self._in_batch(self._batch(query_embeddings, doc_embeddings, None, offset,
                                          f"{type(self).__name__}.forward()"))

    def _batch(self, queries, docs, negatives, offset, where) -> _Batch:
        """The batch this rank scores: queries scaled for ``normalize_scores``; with
        ``gather_across_devices`` the global number of queries, and the documents and
        negatives padded to the longest of any rank."""
        if queries.dim() != 3 or docs.dim() != 3:
            raise ValueError(f"{where}: arguments 'query_embeddings' and 'doc_embeddings' must be 3-D [rows, "
                             f"tokens, dim], but got {list(queries.shape)} and {list(docs.shape)}")
        if negatives is not None and (negatives.dim() != 4 or negatives.size(0) != queries.size(0)):
            raise ValueError(f"{where}: argument 'neg_doc_embeddings' must be [{queries.size(0)}, negatives, "
                             f"tokens, dim] (its query's negatives per row), but got {list(negatives.shape)}")
        b = queries.size(0)
        rows, world, group = b, 1, LOCAL
        if self.gather_across_devices:
            if offset != 0 or docs.size(0) != b:
                raise ValueError(f"{where}: argument 'offset' must be 0 and 'doc_embeddings' this rank's {b} "
                                 "positives with gather_across_devices=True (Contrax gathers every rank's "
                                 f"documents itself), but got offset {offset} and {docs.size(0)} documents")
            group = distributed_group(True, self.group, where)
            world = 1 if group is LOCAL else dist.get_world_size(group)
            if world > 1:
                # The rows, and the longest documents and negatives of every rank. An empty rank's
                # lengths are no row's: counted, they would pad every rank's rows with zero rows that
                # the concatenated batch lacks, and a zero row is the best of a query token whose
                # scores are all negative.
                d_len = docs.size(1) if b else 0
                n_len = negatives.size(2) if b and negatives is not None else 0
                meta = torch.tensor([[b, d_len, n_len]], dtype=torch.int64, device=queries.device)
                meta = gather_no_grad(meta, group)
                rows = int(meta[:, 0].sum())
                docs = _pad_tokens(docs, int(meta[:, 1].max()))
                negatives = _pad_tokens(negatives, int(meta[:, 2].max()))
        elif not 0 <= offset <= docs.size(0) - b:
            raise ValueError(f"{where}: argument 'offset' must leave the {b} queries' positives inside "
                             f"'doc_embeddings' ({docs.size(0)} rows), but got {offset}")
        if self.normalize_scores:
            # Every score of query i is divided by its length; the max commutes with that.
            lengths = (queries[:, :, 0] != 0).sum(1).to(queries.dtype)
            queries = queries / lengths[:, None, None]
        return _Batch(queries, docs, negatives, offset, rows, world, group)

    def _share(self, terms, batch, per_query=1):
        """The mean of `terms` over the global batch's ``rows * per_query`` terms, as this
        rank's share (the ranks' shares average to it), or the local mean alone."""
        if not self.gather_across_devices:
            return terms.mean()
        return terms.sum() * (batch.world / (batch.rows * per_query))

    def _gathered(self, batch):
        """(every rank's positives, this rank's offset among them)."""
        if batch.world == 1:
            return batch.docs, batch.offset
        docs, _, offset = gather_with_grad(batch.docs, batch.group, return_counts=True)
        return docs, offset

    def _positive_mask(self, scores, offset):
        b = scores.size(0)
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[torch.arange(b, device=scores.device), offset + torch.arange(b, device=scores.device)] = True
        return mask

    def _with_negatives(self, batch, in_batch_term_weight):
        """(1 - w) * mean softplus((s(q, neg) - s(q, pos)) / T) + w * the in-batch loss."""
        b = batch.queries.size(0)
        own = batch.docs[batch.offset:batch.offset + b].unsqueeze(1)
        pos = _pair_scores(batch.queries, own)  # [b, 1]
        neg = _pair_scores(batch.queries, batch.negatives)  # [b, k]
        loss = self._share(F.softplus((neg - pos) / self.temperature), batch, batch.negatives.size(1))
        if in_batch_term_weight > 0:
            loss = loss * (1 - in_batch_term_weight) + self._in_batch(batch) * in_batch_term_weight
        return loss


class _WithNegatives:
    """What ColbertNegativeCELoss and ColbertPairwiseNegativeCELoss share: colpali-engine's
    constructor with ``in_batch_term_weight`` (in [0, 1]), and ``forward`` with the negatives.
    Listed before the base that gives the in-batch term."""

    def __init__(self, temperature: float = 0.02, normalize_scores: bool = True, use_smooth_max: bool = False,
                 pos_aware_negative_filtering: bool = False, in_batch_term_weight: float = 0.5,
                 max_batch_size: int = 1024, tau: float = 0.1, norm_tol: float = 1e-3, filter_threshold: float = 0.95,
                 filter_factor: float = 0.5, *, gather_across_devices: bool = False, panel_bytes: int = 16 << 20,
                 group=None):
        super().__init__(temperature, normalize_scores, use_smooth_max, pos_aware_negative_filtering, max_batch_size,
                         tau, norm_tol, filter_threshold, filter_factor, gather_across_devices=gather_across_devices,
                         panel_bytes=panel_bytes, group=group)
        if not (isinstance(in_batch_term_weight, (int, float)) and 0 <= in_batch_term_weight <= 1):
            raise ValueError(f"{type(self).__name__}(): argument 'in_batch_term_weight' must be in [0, 1], but got "
                             f"{in_batch_term_weight!r}")
        self.in_batch_term_weight = float(in_batch_term_weight)

    def forward(self, query_embeddings: torch.Tensor, doc_embeddings: torch.Tensor, neg_doc_embeddings: torch.Tensor,
                offset: int = 0) -> torch.Tensor:
        """Queries ``[b, Lq, d]``, positives ``[m, Ld, d]``, negatives ``[b, k, Ln, d]``."""
        batch = self._batch(query_embeddings, doc_embeddings, neg_doc_embeddings, offset,
                            f"{type(self).__name__}.forward()")
        return self._with_negatives(batch, self.in_batch_term_weight)


class ColbertLoss(_Colbert):
    """colpali-engine's ``ColbertLoss(temperature=0.02, normalize_scores=True, use_smooth_max=False,
    pos_aware_negative_filtering=False, max_batch_size=1024, tau=0.1, norm_tol=1e-3,
    filter_threshold=0.95, filter_factor=0.5)``: InfoNCE of each query against every
    document, its positive ``doc_embeddings[offset + i]``, by ``contrax.maxsim_loss``.

    Contrax's own (keyword only):
        gather_across_devices: every rank's positives are candidates of every query (exact
            across ranks, uneven batches included); ``offset`` must then be 0.
        panel_bytes: the budget of one panel of token scores.
        group: the process group (default: torch.distributed's, when initialised).
    """

    def _in_batch(self, batch):
        docs, b = batch.docs, batch.queries.size(0)
        if batch.world == 1 and (docs.size(0) != b or batch.offset != 0):
            # Documents gathered by the caller (colpali-engine's trainer): maxsim_loss wants
            # query i's positive first in its group of g, and every document is a candidate of
            # every query whichever group holds it, so the others fill the groups in any order.
            if b == 0 or docs.size(0) % b:
                raise ValueError(f"{type(self).__name__}.forward(): argument 'doc_embeddings' must hold a multiple "
                                 f"of the {b} queries' rows (Contrax groups the candidates per query), but got "
                                 f"{docs.size(0)}")
            positives = torch.arange(batch.offset, batch.offset + b, device=docs.device)
            others = torch.ones(docs.size(0), dtype=torch.bool, device=docs.device)
            others[positives] = False
            order = torch.cat([positives[:, None], others.nonzero().view(b, -1)], 1).flatten()
            docs = docs[order]
        mask = (docs != 0).any(-1)  # zero rows are padding, scoring 0 (padding_score)
        return maxsim_loss(batch.queries, docs, None, None, mask, temperature=self.temperature, reduction="mean",
                           padding_score=0.0, panel_bytes=self.panel_bytes, group=batch.group)


class ColbertNegativeCELoss(_WithNegatives, ColbertLoss):
    """colpali-engine's ``ColbertNegativeCELoss(temperature=0.02, normalize_scores=True, use_smooth_max=False,
    pos_aware_negative_filtering=False, in_batch_term_weight=0.5, max_batch_size=1024, tau=0.1,
    norm_tol=1e-3, filter_threshold=0.95, filter_factor=0.5)``: ``(1 - w)`` times the mean of
    ``softplus((s(q, neg) - s(q, pos)) / temperature)`` over each query's own negatives, plus
    ``w`` times ``ColbertLoss``'s in-batch InfoNCE (``w = in_batch_term_weight``, in [0, 1]).
    Contrax's keyword arguments are ``ColbertLoss``'s.
    """


class ColbertPairwiseCELoss(_Colbert):
    """colpali-engine's ``ColbertPairwiseCELoss(temperature=1.0, normalize_scores=True, use_smooth_max=False,
    pos_aware_negative_filtering=False, max_batch_size=1024, tau=0.1, norm_tol=1e-3,
    filter_threshold=0.95, filter_factor=0.5)``: the mean over queries of ``softplus((s(q, hardest
    in-batch negative) - s(q, pos)) / temperature)``. Scored by an einsum over the ``[b x B]``
    pairs (the hardest negative needs the whole row); the documents are gathered with
    ``contrax.gather_with_grad``. Contrax's keyword arguments are ``ColbertLoss``'s
    (``panel_bytes`` chooses nothing here).
    """

    def __init__(self, temperature: float = 1.0, normalize_scores: bool = True, use_smooth_max: bool = False,
                 pos_aware_negative_filtering: bool = False, max_batch_size: int = 1024, tau: float = 0.1,
                 norm_tol: float = 1e-3, filter_threshold: float = 0.95, filter_factor: float = 0.5, *,
                 gather_across_devices: bool = False, panel_bytes: int = 16 << 20, group=None):
        super().__init__(temperature, normalize_scores, use_smooth_max, pos_aware_negative_filtering, max_batch_size,
                         tau, norm_tol, filter_threshold, filter_factor, gather_across_devices=gather_across_devices,
                         panel_bytes=panel_bytes, group=group)

    def _in_batch(self, batch):
        docs, offset = self._gathered(batch)
        scores = _all_scores(batch.queries, docs)  # [b, B]
        positive = self._positive_mask(scores, offset)
        pos = scores[positive]
        hardest = scores.masked_fill(positive, float("-inf")).amax(1)
        return self._share(F.softplus((hardest - pos) / self.temperature), batch)


class ColbertPairwiseNegativeCELoss(_WithNegatives, ColbertPairwiseCELoss):
    """colpali-engine's ``ColbertPairwiseNegativeCELoss(temperature=0.02, normalize_scores=True,
    use_smooth_max=False, pos_aware_negative_filtering=False, in_batch_term_weight=0.5,
    max_batch_size=1024, tau=0.1, norm_tol=1e-3, filter_threshold=0.95, filter_factor=0.5)``:
    ``ColbertNegativeCELoss``'s term over the explicit negatives, plus ``w`` times
    ``ColbertPairwiseCELoss`` (its in-batch term, at this temperature).
    """


class ColbertSigmoidLoss(_Colbert):
    """colpali-engine's ``ColbertSigmoidLoss(temperature=0.02, normalize_scores=True, use_smooth_max=False,
    pos_aware_negative_filtering=False, max_batch_size=1024, tau=0.1, norm_tol=1e-3,
    filter_threshold=0.95, filter_factor=0.5)``: the mean over every query-document pair of
    ``softplus(-y s / temperature)``, y = 1 for the positive and -1 otherwise. Unlike
    colpali-engine's, it takes more documents than queries (``offset``, or gathered).
    """

    def _in_batch(self, batch):
        docs, offset = self._gathered(batch)
        scores = _all_scores(batch.queries, docs)  # [b, B]
        sign = torch.where(self._positive_mask(scores, offset), 1.0, -1.0).to(scores.dtype)
        return self._share(F.softplus(-sign * scores / self.temperature), batch, docs.size(0))
