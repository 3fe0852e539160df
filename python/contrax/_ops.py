"""The fake kernels and autograd formulas of the ``contrax`` PyTorch operators
(``torch.ops.contrax.*``, whose kernels are in python/src/ops.cpp), the
losses' schemas (from their table, contrax/_signatures.py), and the calls
that ``contrax``'s functions make while ``torch.compile`` traces them.

``torch.compile`` cannot look into a pybind function: called on fake tensors
it would need their data. The operators give it what it needs instead: the
shapes of the outputs (the fake kernels below) and how to differentiate them
(``register_autograd``: a loss's backward is its ``*_backward`` operator,
which recomputes; see python/src/ops.cpp for the derivation). Eager calls keep
the binding's functions (one fused autograd function per loss, no
recomputation); only compiled code goes through the operators.

A process group enters an operator as its name. ``group_name`` resolves the
``group=`` argument once per compilation (``torch.compiler.assume_constant_result``)
and registers the group's cached communicator under that name.
"""
import torch
import torch.distributed as dist

from . import LOCAL, _contrax, _signatures

__all__ = ["group_name", "gather_with_grad", "grad_cache_inject"]

_world_of_name = {"": 1}


def group_name(group) -> str:
    """The name an operator knows ``group=`` by ("" for a world of 1), with its
    communicator registered under it."""
    # contrax.LOCAL has no collective: "" without asking. (The compiler of
    # torch 2.6 cannot pass an object that is not a constant, as LOCAL is,
    # to an assume_constant_result function.)
    if group is LOCAL:
        return ""
    return _resolved_group_name(group)


@torch.compiler.assume_constant_result
def _resolved_group_name(group) -> str:
    """``group_name`` of a process group or None, once per compilation."""
    from . import _comm
    comm = _comm(group)
    if comm.world_size == 1:
        return ""
    pg = group if group is not None else dist.group.WORLD
    name = pg.group_name
    _contrax._register_op_group(name, comm)
    _world_of_name[name] = comm.world_size
    return name


def _register_loss(loss: _signatures.Loss) -> None:
    """Schemas, fake kernels and autograd of ``contrax::<loss>`` and ``<loss>_backward``,
    from the loss's table: its tensors (optional ones may be None) are saved
    for the backward, which returns the gradients of ``loss.grad``; the options
    are passed on unchanged."""
    _library.define(_signatures.schema(loss))
    _library.define(_signatures.schema(loss, backward=True))
    names = [p.name for p in loss.params]
    tensors = [i for i, p in enumerate(loss.params) if p.type.startswith("Tensor")]
    grads = [names.index(g) for g in loss.grad]
    reduction_at = names.index("reduction") if "reduction" in names else None
    backward_op = getattr(torch.ops.contrax, loss.name + "_backward")

    def fake(*args):
        # 0-dim, or [b] with reduction="none"; fp32 for fp16/bf16 inputs, else in their dtype.
        x, reduction = args[0], args[reduction_at] if reduction_at is not None else "mean"
        dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        return x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=dtype)

    def fake_backward(grad, *args):
        # An absent optional input's gradient is a 0-dim placeholder.
        return tuple(grad.new_empty(()) if args[i] is None else torch.empty_like(args[i]) for i in grads)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in tensors))
        ctx.options = [None if i in tensors else x for i, x in enumerate(inputs)]

    def backward(ctx, grad):
        inputs = list(ctx.options)
        for i, x in zip(tensors, ctx.saved_tensors):
            inputs[i] = x
        out = [None] * len(inputs)
        for i, g in zip(grads, backward_op(grad, *inputs)):
            out[i] = g if inputs[i] is not None else None
        return tuple(out)

    torch.library.register_fake(f"contrax::{loss.name}")(fake)
    torch.library.register_fake(f"contrax::{loss.name}_backward")(fake_backward)
    torch.library.register_autograd(f"contrax::{loss.name}", backward, setup_context=setup_context)


# The losses' schemas live as long as the module (a Library's definitions go with it).
_library = torch.library.Library("contrax", "FRAGMENT")
for _loss in _signatures.LOSSES.values():
    _register_loss(_loss)


# ---- gather with gradient ------------------------------------------------------------

@torch.library.register_fake("contrax::gather_with_grad")
def _gather_fake(x, group, equal_rows):
    if group == "":
        rows = x.shape[0]
    elif equal_rows:
        rows = x.shape[0] * _world_of_name[group]
    else:
        rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:])), x.new_empty((_world_of_name[group],), dtype=torch.long)


@torch.library.register_fake("contrax::gather_with_grad_backward")
def _gather_backward_fake(grad, counts, rows, group):
    return grad.new_empty((rows, *grad.shape[1:]))


def _gather_setup(ctx, inputs, output):
    x, group, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.rows, ctx.group = x.shape[0], group


def _gather_backward(ctx, grad_all, grad_counts):
    (counts,) = ctx.saved_tensors
    return torch.ops.contrax.gather_with_grad_backward(grad_all, counts, ctx.rows, ctx.group), None, None


torch.library.register_autograd("contrax::gather_with_grad", _gather_backward, setup_context=_gather_setup)


def gather_with_grad(x, group):
    """The rows of every rank (the operator's first output). Their number is
    known when the step runs (an unbacked size) where Dynamo captures such
    operators (``torch._dynamo.config.capture_dynamic_output_shape_ops``);
    otherwise the ranks must hold equal batches (W * b rows, checked)."""
    equal_rows = not torch._dynamo.config.capture_dynamic_output_shape_ops
    return torch.ops.contrax.gather_with_grad(x, group_name(group), equal_rows)[0]


# ---- GradCache: the cached gradient into a representation ----------------------------

@torch.library.register_fake("contrax::grad_cache_inject")
def _inject_fake(rep, grad):
    return rep.new_empty((), dtype=torch.promote_types(rep.dtype, torch.float32))


def _inject_setup(ctx, inputs, output):
    rep, grad = inputs
    ctx.save_for_backward(grad)
    ctx.dtype = rep.dtype


def _inject_backward(ctx, g):
    (cached,) = ctx.saved_tensors
    return (g * cached).to(ctx.dtype), None


torch.library.register_autograd("contrax::grad_cache_inject", _inject_backward, setup_context=_inject_setup)


def grad_cache_inject(rep: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``torch.ops.contrax.grad_cache_inject`` (see ``contrax.grad_cache_inject``)."""
    return torch.ops.contrax.grad_cache_inject(rep, grad)
