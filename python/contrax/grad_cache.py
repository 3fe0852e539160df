"""contrax.GradCache: the gradient-cache training step (GradCache, Gao et al.
2021) for Python encoders, with the contract of the C++ ``contrax::GradCache``,
whose header (include/contrax/parallel/grad_cache.h) explains the passes: each
encoder runs over chunks of its input without a graph (pass 1), the loss runs
once on the detached representations and its backward caches dL/d(rep), and
each chunk re-runs with its saved random state to backpropagate that gradient
(pass 2). Peak activation memory is set by the chunk size, not the batch size.

Since L = loss(f(x_1), ..., f(x_n)), dL/dθ = sum_c J_c^T dL/d(rep_c), with J_c
the Jacobian of chunk c's representation: pass 2 computes exactly these
vector-Jacobian products, one chunk at a time, with
``torch.autograd.backward(rep_c, dL/d(rep_c))`` (no extra graph nodes, unlike a
``(rep * grad).sum()`` surrogate). With DistributedDataParallel encoders each
DDP module all-reduces once per step (see ``GradCache._pass2``).
"""
import contextlib
import dataclasses
import operator
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["GradCache", "GradCacheEncoder"]


def _describe(value) -> str:
    return type(value).__name__


def _integer(value) -> Optional[int]:
    """``value`` as an int; None for a bool or a non-integer."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


class GradCacheEncoder:
    """One encoder of a ``GradCache`` step and how to feed it.

    Args:
        encoder: an ``nn.Module`` (DDP-wrapped or not) or any callable. It is
            called per chunk as ``encoder(chunk)`` for a tensor chunk,
            ``encoder(*chunk)`` for a list/tuple and ``encoder(**chunk)`` for a
            dict (keyword inputs such as ``input_ids=..., attention_mask=...``);
            any other chunk (from a ``split`` function) is passed as one argument.
        chunk_size: rows per chunk, > 0. The last chunk may be shorter.
        get_rep: picks the ``[n, d]`` representation out of the encoder's output
            (e.g. ``lambda out: out.pooler_output``); default: the output must
            be a tensor.
        split: ``split(inputs, chunk_size) -> list of chunks`` for inputs that
            are not split along dim 0 of their tensors (default: tensors of a
            tensor / list / tuple / dict input are sliced along dim 0 together;
            non-tensor entries are passed unchanged to every chunk).
        name: name for ``GradCache.cache(name, ...)`` and error messages.
        ddp: the ``DistributedDataParallel`` module whose gradient
            synchronisation this encoder's backward drives; default: the
            encoder itself when it is a DDP module. Give it when ``encoder`` is
            a callable that calls a DDP module (e.g. ``lambda x: model(x)[0]``),
            or its gradients would be all-reduced once per chunk.

    Example::

        image = contrax.GradCacheEncoder(image_ddp, 64, name="image")
        text = contrax.GradCacheEncoder(text_ddp, 32, name="text",
                                        get_rep=lambda out: out["pooled"])
    """

    def __init__(self, encoder: Callable[..., Any], chunk_size: int, *,
                 get_rep: Optional[Callable[[Any], torch.Tensor]] = None,
                 split: Optional[Callable[[Any, int], Sequence[Any]]] = None,
                 name: Optional[str] = None,
                 ddp: Optional[DistributedDataParallel] = None) -> None:
        if not callable(encoder):
            raise TypeError("GradCacheEncoder(): argument 'encoder' must be an nn.Module or a callable, "
                            f"but got {_describe(encoder)}")
        chunk = _integer(chunk_size)
        if chunk is None or chunk <= 0:
            raise ValueError("GradCacheEncoder(): argument 'chunk_size' must be a positive integer, "
                             f"but got {chunk_size!r}")
        for arg, fn in (("get_rep", get_rep), ("split", split)):
            if fn is not None and not callable(fn):
                raise TypeError(f"GradCacheEncoder(): argument '{arg}' must be callable or None, "
                                f"but got {_describe(fn)}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"GradCacheEncoder(): argument 'name' must be a non-empty string or None, "
                             f"but got {name!r}")
        if ddp is None and isinstance(encoder, DistributedDataParallel):
            ddp = encoder
        if ddp is not None and not isinstance(ddp, DistributedDataParallel):
            raise TypeError("GradCacheEncoder(): argument 'ddp' must be a "
                            f"torch.nn.parallel.DistributedDataParallel or None, but got {_describe(ddp)}")
        self.encoder = encoder
        self.chunk_size = chunk
        self.get_rep = get_rep
        self.split = split
        self.name = name
        self.ddp = ddp

    def __repr__(self) -> str:
        return (f"GradCacheEncoder({_describe(self.encoder)}, chunk_size={self.chunk_size}"
                + (f", name={self.name!r}" if self.name else "")
                + (", ddp" if self.ddp is not None else "") + ")")


# ---- inputs: call convention, tensors, default split -----------------------

def _call(fn, chunk):
    if isinstance(chunk, Mapping):
        return fn(**chunk)
    if isinstance(chunk, (list, tuple)):
        return fn(*chunk)
    return fn(chunk)


def _tensors(value, out):
    """Every tensor in (nested) lists, tuples, dicts and dataclasses: the
    devices whose random state a chunk must save."""
    if torch.is_tensor(value):
        out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _tensors(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _tensors(getattr(value, f.name), out)
    return out


def _default_split(inputs, chunk_size, where):
    """Slices the tensors of a tensor / list / tuple / dict input along dim 0
    together (views); non-tensor entries go unchanged into every chunk. A
    0-row input is one 0-row chunk, so that the encoder still runs (a DDP
    encoder on an empty rank must take part in the gradient all-reduce)."""
    if torch.is_tensor(inputs):
        entries = [("the tensor", inputs)]
    elif isinstance(inputs, Mapping):
        entries = [(f"input '{k}'", v) for k, v in inputs.items()]
    elif isinstance(inputs, (list, tuple)):
        entries = [(f"input {i}", v) for i, v in enumerate(inputs)]
    else:
        raise TypeError(f"{where}: argument 'inputs' is a {_describe(inputs)}, which cannot be split along "
                        "dim 0; pass a tensor, a list/tuple or a dict of tensors, or give the encoder a "
                        "split function (GradCacheEncoder(..., split=...))")
    rows, first = None, None
    for label, v in entries:
        if not torch.is_tensor(v):
            continue
        if v.dim() == 0:
            raise ValueError(f"{where}: argument 'inputs': {label} is 0-dim; every tensor of an input needs "
                             "the batch along dim 0")
        if rows is None:
            rows, first = v.shape[0], label
        elif v.shape[0] != rows:
            raise ValueError(f"{where}: argument 'inputs': {label} has {v.shape[0]} rows but {first} has "
                             f"{rows}; all tensors of an input are split along dim 0 together")
    if rows is None:
        raise ValueError(f"{where}: argument 'inputs' holds no tensor; give the encoder a split function")

    def piece(start, stop):
        if torch.is_tensor(inputs):
            return inputs[start:stop]
        if isinstance(inputs, Mapping):
            return {k: v[start:stop] if torch.is_tensor(v) else v for k, v in inputs.items()}
        values = [v[start:stop] if torch.is_tensor(v) else v for v in inputs]
        # A namedtuple takes its fields as arguments; a list or tuple takes one iterable.
        return type(inputs)(*values) if hasattr(inputs, "_fields") else type(inputs)(values)

    if rows == 0:
        return [piece(0, 0)]
    return [piece(s, min(s + chunk_size, rows)) for s in range(0, rows, chunk_size)]


# ---- random state ------------------------------------------------------------

def _cuda_devices(value):
    return sorted({t.device.index for t in _tensors(value, []) if t.is_cuda})


def _capture_rng(cuda_devices):
    # The CPU default generator always; CUDA generators of the devices the
    # inputs live on (what torch.utils.checkpoint saves). A CUDA kernel on
    # another device is not covered; move such inputs to that device.
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda_devices}


def _restore_rng(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda.items():
        torch.cuda.set_rng_state(s, d)


class _Chunk:
    __slots__ = ("inputs", "rng", "rep", "rows", "shape")

    def __init__(self, inputs, rng, rep):
        self.inputs = inputs
        self.rng = rng
        self.rep = rep              # detached; dropped once copied into the loss leaf
        self.shape = tuple(rep.shape)
        self.rows = rep.shape[0]


class GradCache:
    """Gradient-cache training step: the exact gradients of one big-batch
    contrastive step, with activation memory set by the chunk size.

    Args:
        encoders: ``GradCacheEncoder``s, or bare modules/callables (then
            ``chunk_size`` applies to them). The same module may appear twice
            (tied towers); its DDP still synchronises once per step.
        loss_fn: ``loss_fn(rep_0, rep_1, ...) -> 0-dim tensor`` over this
            rank's representations ``[b_r, d_e]`` in input order, e.g.
            ``lambda img, txt: contrax.clip_loss(img, txt, logit_scale)``. May
            be given per step to ``finish()`` instead. It runs once per step with
            gradients enabled, outside autocast; loss-side parameters get their
            gradient from its one backward (to average such a parameter over
            ranks, return it from a small DDP-wrapped module called inside
            ``loss_fn``, or all-reduce its gradient yourself).
        chunk_size: chunk size for encoders given as bare modules/callables.
        scale_loss: hook mapping the loss to what is backpropagated, e.g.
            ``scaler.scale`` of a ``torch.amp.GradScaler`` (fp16); every
            gradient is then scaled, as in an ordinary scaled step.
        bf16_autocast: run the encoders (both passes) under CPU autocast to
            bfloat16; representations reach ``loss_fn`` in bfloat16.
        replay_rng: save the CPU generator and the CUDA generators of the
            inputs' devices before each chunk and restore them for its second
            pass; turning it off is wrong for any encoder that draws random
            numbers (dropout). After a step the generators are where one pass
            without gradient cache would have left them.

    Gradients are accumulated into ``.grad`` (zero them between steps).

    Example::

        gc = contrax.GradCache(
            [contrax.GradCacheEncoder(image_ddp, 64), contrax.GradCacheEncoder(text_ddp, 64)],
            lambda img, txt: contrax.clip_loss(img, txt, scale_ddp()))
        opt.zero_grad()
        loss = gc.step(images, {"input_ids": ids, "attention_mask": mask})
        opt.step()

    Data-loader form: ``gc.cache(0, x)``, ``gc.cache("text", y)`` as
    sub-batches arrive, then ``gc.finish()`` once the batch is complete.
    """

    def __init__(self, encoders: Sequence[Union[GradCacheEncoder, Callable[..., Any]]],
                 loss_fn: Optional[Callable[..., torch.Tensor]] = None, *,
                 chunk_size: Optional[int] = None,
                 scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 bf16_autocast: bool = False, replay_rng: bool = True) -> None:
        if not isinstance(encoders, (list, tuple)):
            raise TypeError("GradCache(): argument 'encoders' must be a list or tuple of GradCacheEncoder "
                            f"(or modules/callables with chunk_size=), but got {_describe(encoders)}")
        if not encoders:
            raise ValueError("GradCache(): argument 'encoders' is empty")
        specs, names = [], {}
        for e, enc in enumerate(encoders):
            if not isinstance(enc, GradCacheEncoder):
                if chunk_size is None:
                    raise ValueError(f"GradCache(): encoder {e} is a {_describe(enc)}, not a GradCacheEncoder; "
                                     "wrap it in GradCacheEncoder(encoder, chunk_size) or pass argument "
                                     "'chunk_size'")
                enc = GradCacheEncoder(enc, chunk_size)
            if enc.name in names:
                raise ValueError(f"GradCache(): argument 'encoders': encoders {names[enc.name]} and {e} are "
                                 f"both named '{enc.name}'")
            if enc.name is not None:
                names[enc.name] = e
            specs.append(enc)
        for arg, fn in (("loss_fn", loss_fn), ("scale_loss", scale_loss)):
            if fn is not None and not callable(fn):
                raise TypeError(f"GradCache(): argument '{arg}' must be callable or None, but got {_describe(fn)}")
        self.encoders: List[GradCacheEncoder] = specs
        self.loss_fn = loss_fn
        self.scale_loss = scale_loss
        self.bf16_autocast = bool(bf16_autocast)
        self.replay_rng = bool(replay_rng)
        self._names = names
        self._chunks: List[List[_Chunk]] = [[] for _ in specs]

    # ---- helpers -----------------------------------------------------------

    def _label(self, e):
        name = self.encoders[e].name
        return f"encoder '{name}'" if name else f"encoder {e}"

    def _index(self, encoder, where):
        if isinstance(encoder, str):
            if encoder not in self._names:
                known = ", ".join(f"'{n}'" for n in self._names) or "(none)"
                raise ValueError(f"{where}: argument 'encoder': no encoder named '{encoder}'; the named "
                                 f"encoders are {known}")
            return self._names[encoder]
        e = _integer(encoder)
        if e is None:
            raise TypeError(f"{where}: argument 'encoder' must be an index or a name, "
                            f"but got {_describe(encoder)}")
        if not 0 <= e < len(self.encoders):
            raise ValueError(f"{where}: argument 'encoder' is {e}, but there are {len(self.encoders)} encoders "
                             f"(indices 0..{len(self.encoders) - 1})")
        return e

    def _autocast(self):
        if self.bf16_autocast:
            return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, e, inputs):
        enc = self.encoders[e]
        with self._autocast():
            out = _call(enc.encoder, inputs)
            rep = enc.get_rep(out) if enc.get_rep is not None else out
        if not torch.is_tensor(rep):
            if enc.get_rep is not None:
                raise TypeError(f"GradCache: the get_rep of {self._label(e)} returned a {_describe(rep)}, "
                                "not a tensor")
            raise TypeError(f"GradCache: {self._label(e)} returned a {_describe(rep)}, not a tensor; give "
                            "GradCacheEncoder a get_rep function to pick the representation out of it")
        if rep.dim() == 0:
            raise ValueError(f"GradCache: the representation of {self._label(e)} is 0-dim; it must have the "
                             "batch along dim 0")
        return rep

    # ---- public API ----------------------------------------------------------

    def cache(self, encoder: Union[int, str], inputs: Any) -> Optional[torch.Tensor]:
        """Pass 1 on a (sub-)batch of one encoder.

        Splits ``inputs`` into chunks, runs them under ``no_grad`` and keeps
        each chunk's inputs, random state and representation until
        ``finish()``. Call it as sub-batches arrive, for every encoder, in any
        order; rows of an encoder are concatenated in call order.

        Args:
            encoder: index into ``encoders`` or an encoder's ``name``.
            inputs: a tensor, a list/tuple or a dict of tensors (batch along
                dim 0), or anything the encoder's ``split`` function takes.

        Returns:
            The detached representation rows of this call, in order (None if
            a ``split`` function returned no chunks).
        """
        where = "GradCache.cache()"
        e = self._index(encoder, where)
        enc = self.encoders[e]
        if enc.split is not None:
            pieces = list(enc.split(inputs, enc.chunk_size))
        else:
            pieces = _default_split(inputs, enc.chunk_size, where)
        reps = []
        for piece in pieces:
            rng = _capture_rng(_cuda_devices(piece)) if self.replay_rng else None
            with torch.no_grad():
                rep = self._forward(e, piece)
            # A view (e.g. out.last_hidden_state[:, 0]) would keep its whole
            # base output alive until finish(): keep a compact copy instead.
            rep = rep.clone() if rep._base is not None else rep.detach()
            self._chunks[e].append(_Chunk(piece, rng, rep))
            reps.append(rep)
        if not reps:
            return None
        return reps[0] if len(reps) == 1 else torch.cat(reps)

    def finish(self, loss_fn: Optional[Callable[..., torch.Tensor]] = None) -> torch.Tensor:
        """Completes the step over everything cached since the last finish.

        Runs the loss once on the cached representations and its backward,
        then pass 2 (re-forward each chunk with its saved random state,
        backward the cached gradient) with one gradient synchronisation per
        DDP module. The cache is cleared even if this raises.

        Args:
            loss_fn: overrides the constructor's ``loss_fn`` for this step.

        Returns:
            The loss, detached and unscaled (0-dim).
        """
        where = "GradCache.finish()"
        try:
            loss_value, grads = self._loss_grads(loss_fn, where)
            self._replay(self._chunks, grads)
            return loss_value
        finally:
            self.clear()

    def finish_deferred(self, loss_fn: Optional[Callable[..., torch.Tensor]] = None) -> torch.Tensor:
        """``finish()`` for a training loop that calls ``loss.backward()`` itself
        (Hugging Face's Trainer, open_clip's loop).

        Runs the loss and its backward into the cached representations now,
        and returns the loss (0-dim, detached from everything, requiring grad)
        with a hook: when a backward reaches it with gradient ``g`` (1, or a
        gradient accumulation's ``1/K``, or a ``GradScaler``'s scale), pass 2
        runs there, backpropagating ``g`` times each chunk's cached gradient,
        with the same random-state replay and one gradient synchronisation per
        DDP module as ``finish()``. Loss-side parameters got their gradient
        unscaled from the loss's backward, here. The generators are left
        where the backward found them. The cache is free for the next step at
        once; the hook holds this step's chunks until it has run (once: a
        second backward through the returned loss is an error).

        Args:
            loss_fn: overrides the constructor's ``loss_fn`` for this step.

        Returns:
            The loss value as a new leaf whose backward runs pass 2.
        """
        where = "GradCache.finish_deferred()"
        try:
            loss_value, grads = self._loss_grads(loss_fn, where)
            chunks = self._chunks
            self._chunks = [[] for _ in self.encoders]
        finally:
            self.clear()
        pending = [chunks, grads]

        def replay(grad_output):
            if pending[0] is None:
                raise RuntimeError("GradCache.finish_deferred(): a backward already ran through this loss; its "
                                   "second pass has been done (compute the step again instead)")
            step_chunks, step_grads = pending
            pending[0] = pending[1] = None
            if not (grad_output.numel() == 1 and grad_output.item() == 1.0):
                step_grads = [[g * grad_output.reshape(()) for g in per] for per in step_grads]
            self._replay(step_chunks, step_grads)

        out = loss_value.clone().requires_grad_(True)
        out.register_hook(replay)
        return out

    def _replay(self, chunks_of, grads):
        """Pass 2, after which the generators are put back where it found them:
        where each chunk running once (the loss included) leaves them, so
        later steps draw what they would have drawn without gradient cache."""
        if not self.replay_rng:
            return self._pass2(chunks_of, grads)
        state = _capture_rng(sorted({d for per in chunks_of for c in per for d in c.rng[1]}))
        try:
            self._pass2(chunks_of, grads)
        finally:
            _restore_rng(state)

    def _loss_grads(self, loss_fn, where):
        """The loss (``loss_fn``, else the constructor's) over the cached
        representations and its one backward, once every encoder has cached
        something: (detached loss value, per encoder the cached gradient split
        by chunk)."""
        loss_fn = loss_fn if loss_fn is not None else self.loss_fn
        if loss_fn is None:
            raise ValueError(f"{where}: argument 'loss_fn' is required: none was given here or to GradCache()")
        if not callable(loss_fn):
            raise TypeError(f"{where}: argument 'loss_fn' must be callable, but got {_describe(loss_fn)}")
        for e, chunks in enumerate(self._chunks):
            if not chunks:
                raise ValueError(f"{where}: {self._label(e)} has cached nothing; call cache() for every "
                                 f"encoder before {where.split('.', 1)[1]} (an empty rank caches a 0-row input)")
        leaves = []
        for chunks in self._chunks:
            parts = [c.rep for c in chunks]
            for c in chunks:
                c.rep = None  # the leaf holds the only copy from here on
            leaves.append((parts[0] if len(parts) == 1 else torch.cat(parts)).detach().requires_grad_(True))
            del parts
        with torch.enable_grad():
            loss = loss_fn(*leaves)
            if not torch.is_tensor(loss) or loss.numel() != 1:
                got = f"shape {list(loss.shape)}" if torch.is_tensor(loss) else f"a {_describe(loss)}"
                raise ValueError(f"{where}: argument 'loss_fn' must return a single-element tensor, but "
                                 f"returned {got}")
            if not loss.requires_grad:
                raise ValueError(f"{where}: the loss returned by 'loss_fn' does not depend on the "
                                 "representations it was given (it does not require grad)")
            to_backward = self.scale_loss(loss) if self.scale_loss is not None else loss
            if not torch.is_tensor(to_backward) or to_backward.numel() != 1:
                raise ValueError(f"{where}: argument 'scale_loss' must return a single-element tensor")
            loss_value = loss.detach().reshape(())
            torch.autograd.backward(to_backward.reshape(()))
        del loss, to_backward
        # A representation the loss ignores gets a zero gradient: its encoder
        # still runs pass 2, so that a DDP module sees all its parameters.
        grads = []
        for leaf, chunks in zip(leaves, self._chunks):
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            grads.append(g.split([c.rows for c in chunks]))
        del leaves
        return loss_value, grads

    def _pass2(self, chunks_of, grads):
        # The one synchronised chunk of each DDP module: the last chunk of the
        # last encoder using it (tied towers share one). Every other chunk's
        # forward runs under no_sync, which is what DDP checks (at forward
        # time) to decide whether the backward all-reduces. One armed backward
        # per module and step whatever the chunk counts, so ranks with uneven
        # rows issue the same collectives.
        final = {}
        for e, enc in enumerate(self.encoders):
            if enc.ddp is not None:
                final[id(enc.ddp)] = (e, len(chunks_of[e]) - 1)
        with torch.enable_grad():
            for e, enc in enumerate(self.encoders):
                for i, c in enumerate(chunks_of[e]):
                    synced = enc.ddp is None or final[id(enc.ddp)] == (e, i)
                    with (contextlib.nullcontext() if synced else enc.ddp.no_sync()):
                        if c.rng is not None:
                            _restore_rng(c.rng)
                        rep = self._forward(e, c.inputs)
                        if tuple(rep.shape) != c.shape:
                            raise RuntimeError(
                                f"GradCache: {self._label(e)} gave a representation of shape {list(rep.shape)} "
                                f"in the second pass but {list(c.shape)} in the first; the encoder must be "
                                "deterministic given its input and random state")
                        if rep.requires_grad:  # a frozen encoder has nothing to backpropagate into
                            torch.autograd.backward(rep, grads[e][i].to(rep.dtype))
                    c.inputs = None  # release the chunk's inputs as soon as it is done

    def step(self, *inputs: Any) -> torch.Tensor:
        """One whole step: ``inputs[e]`` goes to encoder ``e``.

        Same as ``clear()``, ``cache(e, inputs[e])`` for every encoder and
        ``finish()``. Returns the loss, detached and unscaled.
        """
        if len(inputs) != len(self.encoders):
            raise ValueError(f"GradCache.step(): got {len(inputs)} inputs for {len(self.encoders)} encoders")
        self.clear()
        try:
            for e, x in enumerate(inputs):
                self.cache(e, x)
        except BaseException:
            self.clear()
            raise
        return self.finish()

    __call__ = step

    def cached_rows(self, encoder: Union[int, str]) -> int:
        """Rows cached for ``encoder`` (index or name) since the last ``finish()``."""
        e = self._index(encoder, "GradCache.cached_rows()")
        return sum(c.rows for c in self._chunks[e])

    def clear(self) -> None:
        """Drops everything cached (``finish()`` and a failed ``step()`` do this themselves)."""
        for chunks in self._chunks:
            chunks.clear()
