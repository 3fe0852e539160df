"""The one declaration of each loss's parameters in Python.

``LOSSES`` lists every loss's parameters in order (name, schema type,
default, doc line), and everything else is derived from it: the public
functions of ``contrax`` (signature and docstring), the ``torch.library``
schemas of their operators (``contrax/_ops.py``), the ``nn.Module`` wrappers'
constructor options (``contrax/modules.py``) and the type stub's losses
and Modules (tools/gen_stub.py prints them;
python/tests/test_signatures.py fails when ``__init__.pyi`` or any face
disagrees). The C++ side takes the arguments in the same order: the
binding's functions (python/src/bind_*.cpp) and the operators' kernels
(python/src/ops.cpp; the dispatcher checks their types against the schema).
Adding a parameter is an edit here and one in C++.
"""
import inspect
import textwrap
from typing import Any, Callable, Iterable, NamedTuple, Tuple

REQUIRED = inspect.Parameter.empty


class Param(NamedTuple):
    """One parameter: ``type`` is its schema type (``Tensor``, ``Tensor?``,
    ``bool``, ``float``, ``int``, ``str``, ``int[]``, ``float[]`` (a
    sequence; the default an empty tuple), or ``group``: a ProcessGroup in
    Python, its name in a schema); ``doc`` is empty when the next parameter's
    line documents both (``a, b: ...``); ``words`` are the strings a ``str``
    takes."""
    name: str
    type: str
    default: Any = REQUIRED
    doc: str = ""
    words: Tuple[str, ...] = ()


class Loss(NamedTuple):
    """One loss: its parameters, the first ``positional`` of which may be
    passed by position; ``grad``, the tensors it is differentiable in."""
    name: str
    summary: str
    positional: int
    params: Tuple[Param, ...]
    grad: Tuple[str, ...]
    returns: str
    raises: Tuple[str, ...] = ()


_MODES = ("multi_positive", "mask_duplicates")
_REDUCTIONS = ("mean", "sum", "none")
_BIAS = Param("logit_bias", "Tensor?", None, "optional 0-dim bias added to every logit.")
_PATH = Param("path", "str", "auto", words=("auto", "materialised", "tiled"))
_TILE = Param("tile_size", "int", 0)
_RING = Param("ring", "bool", False, "the memory path (see ``clip_loss``).")
_GROUP = Param("group", "group", None, "``torch.distributed`` ProcessGroup or None (see ``clip_loss``).")
_MAX_SCALE = Param("max_logit_scale", "float", 100.0, "clamp of ``exp(logit_scale)``.")
_DIMS = Param("matryoshka_dims", "int[]", ())
_WEIGHTS = Param("matryoshka_weights", "float[]", (), "Matryoshka prefixes: widths (any order, each in ``[1, d]``) "
                 "and their weights (default 1 each); the loss becomes ``sum_p w_p loss(features[:, :m_p])`` with "
                 "every prefix L2-normalised inside the loss whatever ``normalize`` says, the full width ``d`` always "
                 "among them (weight 1 when not listed). Empty: one dot product of the whole width.")
_MATRYOSHKA = (_DIMS, _WEIGHTS)


def _temperature_loss(name, tensors, default_t, summary, tensor_docs, t_doc, reduction_doc, returns, grad):
    """NT-Xent and MoCo v3: tensors, then temperature, normalize, reduction and the memory path."""
    params = tuple(Param(t, "Tensor", doc=tensor_docs.get(t, "")) for t in tensors)
    params += (Param("temperature", "float", default_t, t_doc),
               Param("normalize", "bool", True, "L2-normalise inside the loss."),
               Param("reduction", "str", "mean", reduction_doc, _REDUCTIONS), *_MATRYOSHKA, _PATH, _TILE, _RING,
               _GROUP)
    return Loss(name, summary, len(tensors), params, grad, returns)


LOSSES = {loss.name: loss for loss in (
    Loss("clip_loss", "CLIP / InfoNCE loss over the global batch.", 4, (
        Param("a", "Tensor"),
        Param("b", "Tensor", doc="``[b_r, d]`` paired features on this rank (row i of ``a`` matches row i of "
              "``b``); ranks may hold different ``b_r`` (even 0)."),
        Param("logit_scale", "Tensor", doc="0-dim tensor, the *log* of the scale (CLIP's learnable parameter); "
              "logits are ``a @ b_all.T * min(exp(logit_scale), max_logit_scale)``."),
        _BIAS,
        Param("symmetric", "bool", True, "``(CE(a->b) + CE(b->a)) / 2`` if True, else ``CE(a->b)`` (InfoNCE)."),
        _MAX_SCALE,
        Param("normalize", "bool", False, "L2-normalise ``a`` and ``b`` inside the loss."),
        Param("labels", "Tensor?", None, "optional int64 ``[b_r]``, this rank's rows' labels (gathered inside). "
              "Rows with equal labels are positives of each other (``label_mode=\"multi_positive\"``: ``l_i = "
              "lse_i - mean of the positives' logits``) or removed from each other's softmax "
              "(``\"mask_duplicates\"``: false-negative masking)."),
        Param("label_mode", "str", "multi_positive", "``\"multi_positive\"`` or ``\"mask_duplicates\"``.", _MODES),
        Param("reduction", "str", "mean", "``\"mean\"`` (``L_r = (W/B) sum_{i in r} l_i``), ``\"sum\"`` (``W "
              "sum_{i in r} l_i``) or ``\"none\"`` (the ``[b_r]`` per-row losses, each the exact global-batch "
              "loss of that row; every rank must run backward, which all-gathers the upstream gradients when "
              "symmetric).", _REDUCTIONS),
        *_MATRYOSHKA,
        _PATH._replace(doc="memory path, as every loss spells it: ``\"auto\"`` (default: materialise the ``[b x "
                       "B]`` logits while they take at most 256 MiB per rank, else tiled), ``\"materialised\"`` "
                       "or ``\"tiled\"`` (memory ``O(b x tile)``, same value and gradients)."),
        _TILE._replace(doc="tiled path: the tile side (0: about 16 MiB per tile); a positive value with "
                       "``path=\"auto\"`` selects tiles."),
        _RING._replace(doc="tiled path (implied): key blocks travel around the ring."),
        _GROUP._replace(doc="``torch.distributed`` ProcessGroup (default: the default group if initialised, "
                        "else single device)."),
    ), ("a", "b", "logit_scale", "logit_bias"),
        "0-dim tensor ``L_r = (W/B) * sum of this rank's per-row losses`` (see ``reduction``); differentiable in "
        "``a``, ``b``, ``logit_scale`` and ``logit_bias``.",
        ("ValueError: bad argument (on every rank; the others name the failing rank).",
         "RuntimeError: a collective failed (e.g. a peer died).")),
    Loss("grouped_loss", "DPR/Tevatron-style retrieval loss with hard negatives over the global batch.", 4, (
        Param("queries", "Tensor", doc="``[b_r, d]``."),
        Param("candidates", "Tensor", doc="``[b_r * g, d]``, grouped per query: rows ``i*g .. i*g+g-1`` belong to "
              "query i, its positive first, then ``g-1`` hard negatives. ``g`` must be the same on every rank (a "
              "rank may hold 0 queries). Every candidate of every rank is a negative of every other query."),
        Param("logit_scale", "Tensor", doc="0-dim, the *log* of the scale (as in ``clip_loss``)."),
        _BIAS._replace(doc="optional 0-dim bias."),
        Param("labels", "Tensor?", None, "optional int64 ``[b_r]``, the id of each query's positive."),
        Param("candidate_labels", "Tensor?", None, "optional int64 ``[b_r * g]``, the id of each candidate "
              "(required with ``labels`` when ``g > 1``)."),
        Param("label_mode", "str", "mask_duplicates", "``\"mask_duplicates\"`` (default: a candidate carrying the "
              "query's id, other than its own positive, leaves the softmax) or ``\"multi_positive\"`` (it counts "
              "as another positive).", _MODES),
        Param("reduction", "str", "mean", "``\"mean\"`` over the global number of queries, ``\"sum\"`` or "
              "``\"none\"`` (see ``clip_loss``).", _REDUCTIONS),
        _MAX_SCALE._replace(doc="clamp of ``exp(logit_scale)`` (as in ``clip_loss``)."),
        Param("normalize", "bool", False, "L2-normalise ``queries`` and ``candidates`` inside the loss."),
        *_MATRYOSHKA, _PATH, _TILE, _RING._replace(doc="the memory path (see ``clip_loss``); with ``ring`` the candidate blocks "
                                     "travel around the ring."),
        _GROUP,
    ), ("queries", "candidates", "logit_scale", "logit_bias"),
        "``l_i = lse_i - S_{i, pos(i)}`` reduced as ``reduction`` says; differentiable in ``queries``, "
        "``candidates``, ``logit_scale`` and ``logit_bias``."),
    _temperature_loss(
        "nt_xent_loss", ("z1", "z2"), 0.1,
        "SimCLR's NT-Xent loss over the global batch of ``2B`` views.\n\nFor view-1 row i the logits are ``[z1_i "
        ". z2_all | z1_i . z1_all] / T`` with\nits own column in the second block masked out (likewise for view "
        "2); the\nloss is the mean over all ``2B`` rows, per-rank weighted as in ``clip_loss``.",
        {"z2": "``[b_r, d]`` projections of the two views of the same images."},
        "softmax temperature, > 0.",
        "``\"mean\"``, ``\"sum\"`` or ``\"none\"`` (``[b_r]``) over the ``B`` examples (an example's loss is the "
        "mean of its two views').",
        "0-dim tensor, differentiable in ``z1`` and ``z2``.", ("z1", "z2")),
    _temperature_loss(
        "moco_v3_loss", ("q1", "q2", "k1", "k2"), 1.0,
        "MoCo v3's symmetrised loss ``ctr(q1, k2) + ctr(q2, k1)``.\n\n``ctr(q, k) = CE(q @ k_all.T / T, "
        "positives) * 2T``; the keys (momentum\nencoder outputs) are gathered without gradient.",
        {"q2": "``[b_r, d]`` queries (with gradient).", "k2": "``[b_r, d]`` keys (treated as constants)."},
        "softmax temperature (MoCo v3 ViT uses 0.2).",
        "``\"mean\"``, ``\"sum\"`` or ``\"none\"`` over the ``B`` examples (an example's loss is ``2T (l(q1_i, "
        "k2) + l(q2_i, k1))``).",
        "0-dim tensor (``[b_r]`` with ``\"none\"``), differentiable in ``q1`` and ``q2``.", ("q1", "q2")),
    Loss("siglip_loss", "SigLIP's pairwise sigmoid loss over the global batch.\n\n``loss = -(1/B) sum_i sum_j "
         "log sigmoid(z_ij (exp(logit_scale) a_i.b_j + bias))``\nwith ``z_ij = +1`` on the diagonal and ``-1`` "
         "elsewhere. No softmax couples a\nrow, so no logits need to be held beyond one tile. Per-rank weighting "
         "as in\n``clip_loss``.", 4, (
             Param("a", "Tensor"), Param("b", "Tensor", doc="``[b_r, d]`` paired features."),
             Param("logit_scale", "Tensor", doc="0-dim log scale (SigLIP initialises it to log 10)."),
             _BIAS._replace(doc="optional 0-dim bias (SigLIP: -10)."),
             _MAX_SCALE._replace(default=float("inf"), doc="clamp of ``exp(logit_scale)`` (default none)."),
             Param("normalize", "bool", False, "L2-normalise ``a`` and ``b`` inside the loss."),
             *_MATRYOSHKA, _PATH, _TILE, _RING, _GROUP,
         ), ("a", "b", "logit_scale", "logit_bias"),
         "0-dim tensor ``L_r``, differentiable in ``a``, ``b``, ``logit_scale`` and ``logit_bias``."),
    Loss("maxsim_loss", "Late-interaction (ColBERT / ColPali / PyLate) InfoNCE loss over the global batch.\n\n"
         "``score(i, j)`` is the sum over query i's valid tokens of the largest dot\nproduct with document j's "
         "valid tokens (MaxSim); the logits are the scores\ntimes ``exp(logit_scale)`` (clamped) or divided by "
         "``temperature``. The token\nscores of a pair exist only inside panels of ``panel_bytes``. Per-rank\n"
         "weighting as in ``clip_loss``.", 5, (
             Param("queries", "Tensor", doc="``[b_r, Lq, d]`` query token embeddings."),
             Param("documents", "Tensor", doc="``[b_r * g, Ld, d]`` document token embeddings, grouped per query "
                   "(its positive, then ``g - 1`` hard negatives); every document of every rank is a negative of "
                   "every other query. Ranks may pad to different ``Ld``."),
             Param("logit_scale", "Tensor?", None, "optional 0-dim *log* of the scale (learnable); None: "
                   "``1 / temperature``."),
             Param("query_mask", "Tensor?", None),
             Param("document_mask", "Tensor?", None, "optional bool ``[b_r, Lq]`` / ``[b_r * g, Ld]``: the valid "
                   "tokens (default all); every document needs one."),
             Param("temperature", "float", 1.0, "divides the scores when no ``logit_scale`` is given; > 0."),
             _MAX_SCALE._replace(doc="clamp of ``exp(logit_scale)``."),
             Param("normalize_scores", "bool", False, "divide each query's score by its number of valid tokens."),
             Param("symmetric", "bool", False, "also the documents-to-queries direction (``g = 1``); every rank "
                   "must run backward."),
             Param("reduction", "str", "mean", "``\"mean\"`` over the global number of queries, ``\"sum\"`` or "
                   "``\"none\"`` (see ``clip_loss``).", _REDUCTIONS),
             Param("padding_score", "float", float("-inf"), "what a masked document token scores: ``-inf`` (it never "
                   "counts) or a number (PyLate's and colpali-engine's masks make it 0: a query token then scores at "
                   "least 0 against a document with padding of its own)."),
             Param("panel_bytes", "int", 16 << 20, "budget of one panel of token scores (forward and backward)."),
             _PATH._replace(doc="memory path (as ``clip_loss``): ``\"auto\"`` (default: materialise the ``[b x B "
                            "g]`` scores while they take at most 256 MiB per rank, else tiled), "
                            "``\"materialised\"`` or ``\"tiled\"`` (the scores walked in steps of queries x "
                            "documents, never held whole; same value and gradients)."),
             _TILE._replace(doc="tiled path: at most this many queries and documents a step (0: about 16 MiB of "
                            "logits); a positive value with ``path=\"auto\"`` selects the tiled path."),
             _RING._replace(doc="tiled path (implied): the documents (tokens, masks) travel around the ring with "
                            "their gradients instead of being gathered."),
             _GROUP,
         ), ("queries", "documents", "logit_scale"),
         "0-dim tensor ``L_r`` (``[b_r]`` with ``\"none\"``), differentiable in ``queries``, ``documents`` and "
         "``logit_scale``."),
)}


_ANNOTATIONS = {"Tensor": "torch.Tensor", "Tensor?": "Optional[torch.Tensor]", "group": "Optional[ProcessGroup]",
                "int[]": "Sequence[int]", "float[]": "Sequence[float]"}


def annotation(p: Param) -> str:
    """The parameter's Python annotation, as the stub writes it."""
    if p.words:
        return "Literal[%s]" % ", ".join('"%s"' % w for w in p.words)
    return _ANNOTATIONS.get(p.type, p.type)


def cast(p: Param) -> Callable[[Any, str], Any]:
    """What a value of ``p`` becomes before it reaches C++: the schema type's
    Python value (``float``, ``int``, ``bool``, ``str``; tensors as they
    are). A value of another kind is a TypeError naming the function
    (``what``), the argument and what it takes, instead of pybind11's list
    of signatures."""
    import operator

    import torch

    def wrong(value: Any, what: str, expected: str) -> Any:
        raise TypeError("%s(): argument '%s' must be %s, but got %s" % (what, p.name, expected, type(value).__name__))

    def tensor(value: Any, what: str) -> Any:
        if isinstance(value, torch.Tensor) or (value is None and p.type == "Tensor?"):
            return value
        return wrong(value, what, "a Tensor or None" if p.type == "Tensor?" else "a Tensor")

    def convert(kind: Callable[[Any], Any], expected: str) -> Callable[[Any, str], Any]:
        def to(value: Any, what: str) -> Any:
            if value is None or isinstance(value, (str, bytes)) != (kind is str):
                return wrong(value, what, expected)
            try:
                return kind(value)
            except (TypeError, ValueError):
                return wrong(value, what, expected)
        return to

    def sequence(kind: Callable[[Any], Any], expected: str) -> Callable[[Any, str], Any]:
        def to(value: Any, what: str) -> Any:
            if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
                return wrong(value, what, expected)
            try:
                return tuple(kind(v) for v in value)
            except (TypeError, ValueError):
                return wrong(value, what, expected)
        return to

    kinds = {"Tensor": tensor, "Tensor?": tensor, "group": lambda value, what: value,
             "int[]": sequence(operator.index, "a sequence of integers"),
             "float[]": sequence(float, "a sequence of numbers"),
             "float": convert(float, "a number"), "int": convert(operator.index, "an integer"),
             "bool": convert(bool, "True or False"), "str": convert(str, "a string")}
    return kinds[p.type]


def options(loss: Loss) -> Tuple[Param, ...]:
    """The parameters that are not tensors: what a loss's Module holds."""
    return tuple(p for p in loss.params if not p.type.startswith("Tensor"))


def signature(loss: Loss) -> inspect.Signature:
    """The public function's signature (annotations as strings)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return inspect.Signature([inspect.Parameter(p.name, kinds[i >= loss.positional], default=p.default,
                                                annotation=annotation(p)) for i, p in enumerate(loss.params)],
                             return_annotation="torch.Tensor")


def docstring(loss: Loss) -> str:
    """The public function's docstring: the summary, one ``Args`` line per
    documented run of parameters, and ``Returns``."""
    def entry(text):
        return textwrap.fill(text, 79, initial_indent="    ", subsequent_indent="        ")

    lines, names = [loss.summary, "", "Args:"], []
    for p in loss.params:
        names.append(p.name)
        if p.doc:
            lines.append(entry("%s: %s" % (", ".join(names), p.doc)))
            names = []
    lines += ["", "Returns:", textwrap.fill(loss.returns, 79, initial_indent="    ", subsequent_indent="    ")]
    if loss.raises:
        lines += ["", "Raises:", *map(entry, loss.raises)]
    return "\n".join(lines)


def schema(loss: Loss, backward: bool = False) -> str:
    """The operator's schema; ``<loss>_backward`` takes the upstream gradient
    first and returns the gradients of ``loss.grad``."""
    args = ", ".join("%s %s" % ("str" if p.type == "group" else p.type, p.name) for p in loss.params)
    if backward:
        return "%s_backward(Tensor grad, %s) -> (%s)" % (loss.name, args, ", ".join(["Tensor"] * len(loss.grad)))
    return "%s(%s) -> Tensor" % (loss.name, args)


class _Default:
    """A default in generated source: the name under which it is looked up."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return "_defaults[%r]" % self.name


def function(loss: Loss, impl: Callable[..., Any], module: str) -> Callable[..., Any]:
    """A plain Python function with the loss's signature and docstring that
    returns ``impl(*arguments in the table's order)``. It is generated as source (as ``collections.namedtuple`` does) so that calling
    it costs what any function call costs and ``torch.compile`` traces it."""
    sig = signature(loss)
    params = [p.replace(default=_Default(p.name)) if p.default is not REQUIRED else p
              for p in sig.parameters.values()]
    names = ", ".join(p.name for p in loss.params)
    # ``_impl`` is a closure variable, not a global of the generated source:
    # torch 2.6's Dynamo guards a global of an inlined function by looking it
    # up as an attribute of the module named by ``__name__`` (``contrax._impl``,
    # which does not exist), so a global here broke every compiled step there.
    source = "def _make(_impl, _defaults):\n    def %s%s:\n        return _impl(%s)\n    return %s\n" % (
        loss.name, sig.replace(parameters=params), names, loss.name)
    namespace = {"__name__": module}
    exec(source, namespace)
    fn = namespace["_make"](impl, {p.name: p.default for p in loss.params})
    fn.__doc__ = docstring(loss)
    fn.__signature__ = sig
    return fn
