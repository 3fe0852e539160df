"""PyLate's ``losses.Contrastive`` (ColBERT training) computed exactly by Contrax.

The swap::

    from pylate import losses                                   # before
    from contrax.integrations import pylate as losses           # after

    loss = losses.Contrastive(model=model, gather_across_devices=True, temperature=0.05)

Same arguments and the same ``forward(sentence_features, labels)``, so
``SentenceTransformerTrainer`` (PyLate's training loop) needs nothing else.
Columns: the queries, then one or more document columns: the positive, then
hard negatives. Each query's candidates are every document of every column
of the (gathered) batch. Its score is ColBERT's MaxSim over L2-normalised
token embeddings. Masked document tokens score 0, as PyLate's multiplied
masks make them. With query expansion (the ColBERT default) every query
token counts; otherwise the query's attention mask applies.

What changes underneath: the loss is ``contrax.maxsim_loss``.
* **No token-score tensor for the batch.** The token scores of a
  query-document pair exist only inside panels of ``panel_bytes``; PyLate's
  einsum holds ``[queries x documents x Lq x Ld]`` per document column.
* **Exact across ranks with uneven batches.** PyLate's
  ``labels + rank * batch_size`` and its ``loss * world_size`` assume equal
  batches on every rank. Ranks may also pad their documents to different
  lengths.

Refused, with the reason: a ``score_metric`` other than ColBERT's MaxSim
(``pylate.scores.ColBERTScores``, the default). ``score_mini_batch_size`` is
accepted and has nothing to do: Contrax's panels already bound the forward's
memory, and the backward's too. Contrax-only keyword arguments:
``panel_bytes`` and ``group``.
"""
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F

from .. import maxsim_loss
from ._groups import distributed_group

__all__ = ["Contrastive"]


def _attribute(model, name: str, default):
    """An attribute of the ColBERT model, or of the module a (D)DP wrapper holds."""
    if hasattr(model, name):
        return getattr(model, name)
    return getattr(getattr(model, "module", None), name, default)


def _valid_tokens(features: Dict[str, torch.Tensor], skiplist: List[int]) -> torch.Tensor:
    """The attention mask without the skiplist's tokens (punctuation), as bool."""
    ids = features["input_ids"]
    keep = features["attention_mask"].to(torch.bool)
    if skiplist:
        keep = keep & ~torch.isin(ids, torch.tensor(skiplist, dtype=ids.dtype, device=ids.device))
    return keep


class Contrastive(torch.nn.Module):
    """PyLate's ``Contrastive(model, score_metric=None, score_mini_batch_size=None,
    size_average=True, gather_across_devices=False, temperature=1.0)``.

    Arguments of PyLate:
        model: the ColBERT model (its ``skiplist`` and ``do_query_expansion`` are read).
        score_metric: None or ``pylate.scores.ColBERTScores()`` (MaxSim; anything else is refused).
        score_mini_batch_size: accepted; Contrax's panels bound the memory instead.
        size_average: the mean over the global batch's queries (True) or their sum.
        gather_across_devices: every rank's documents are negatives of every query.
        temperature: the scores are divided by it, > 0.
    Contrax's own (keyword only):
        panel_bytes: the budget of one panel of token scores.
        group: the process group (default: torch.distributed's, when initialised).
    """

    def __init__(self, model, score_metric=None, score_mini_batch_size: Optional[int] = None,
                 size_average: bool = True, gather_across_devices: bool = False, temperature: float = 1.0, *,
                 panel_bytes: int = 16 << 20, group=None):
        super().__init__()
        if score_metric is not None and type(score_metric).__name__ != "ColBERTScores":
            raise ValueError("Contrastive(): argument 'score_metric' must be None or pylate.scores.ColBERTScores() "
                             "(Contrax computes ColBERT's MaxSim itself), but got " + type(score_metric).__name__)
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"Contrastive(): argument 'temperature' must be > 0, but got {temperature!r}")
        self.model = model
        self.score_metric = score_metric
        self.score_mini_batch_size = score_mini_batch_size
        self.size_average = bool(size_average)
        self.gather_across_devices = bool(gather_across_devices)
        self.temperature = float(temperature)
        self.panel_bytes = int(panel_bytes)
        self.group = group

    def forward(self, sentence_features: Iterable[Dict[str, torch.Tensor]], labels=None) -> torch.Tensor:
        """The loss of a batch's tokenised columns: the queries, then the document columns
        (``labels`` is ignored, as in PyLate)."""
        features = list(sentence_features)
        if len(features) < 2:
            raise ValueError("Contrastive.forward(): argument 'sentence_features' must hold the queries and at least "
                             f"one document column, but got {len(features)} column(s)")
        embeddings = [F.normalize(self.model(f)["token_embeddings"], p=2, dim=-1) for f in features]
        skiplist = list(_attribute(self.model, "skiplist", []) or [])
        expansion = bool(_attribute(self.model, "do_query_expansion", False))
        queries, columns = embeddings[0], embeddings[1:]
        query_mask = None if expansion else features[0]["attention_mask"].to(torch.bool)
        # [b, g, Ld, d] -> [b g, Ld, d]: each query's positive, then its hard negatives.
        documents = torch.stack(columns, dim=1).flatten(0, 1)
        document_mask = torch.stack([_valid_tokens(f, skiplist) for f in features[1:]], dim=1).flatten(0, 1)
        where = "Contrastive(gather_across_devices=True)"
        return maxsim_loss(queries, documents, None, query_mask, document_mask, temperature=self.temperature,
                           reduction="mean" if self.size_average else "sum", padding_score=0.0,
                           panel_bytes=self.panel_bytes,
                           group=distributed_group(self.gather_across_devices, self.group, where))

    def get_config_dict(self) -> Dict[str, Any]:
        """PyLate's configuration keys, for the model card."""
        return {"size_average": self.size_average, "gather_across_devices": self.gather_across_devices,
                "temperature": self.temperature}
