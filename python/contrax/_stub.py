"""The generated parts of ``__init__.pyi``: the losses' functions, from their
table (``_signatures.LOSSES`` and ``TILED``), and the losses' Modules, from
the classes themselves (their options come from the same table).
``python -m contrax._stub`` prints both blocks; python/tests/test_signatures.py
fails when ``__init__.pyi`` does not hold them, so adding a parameter is an
edit of the table and a paste of this output.
"""
import inspect
from typing import Iterable

from . import _signatures
from ._signatures import REQUIRED, TILED, Loss, annotation, deprecation
from .modules import ClipLoss, GroupedLoss, MoCoV3Loss, NTXentLoss, SigLIPLoss

_WIDTH = 116


def _wrap(head: str, parts: Iterable[str], tail: str, indent: str) -> str:
    """``head`` + the comma-separated ``parts`` + ``tail``, broken before a part
    that would pass the stub's width, continued at ``indent``."""
    parts = list(parts)
    lines, line = [], head
    for i, part in enumerate(parts):
        part += ", " if i + 1 < len(parts) else tail
        if len(line) + len(part.rstrip()) > _WIDTH:
            lines.append(line.rstrip())
            line = indent
        line += part
    return "\n".join(lines + [line])


def function(loss: Loss) -> str:
    """The loss's declaration (the always-tiled ones marked ``@deprecated``)."""
    params = ["%s: %s%s" % (p.name, annotation(p), "" if p.default is REQUIRED else " = ...") for p in loss.params]
    params.insert(loss.positional, "*")
    text = _wrap("def %s(" % loss.name, params, ") -> torch.Tensor: ...", "    ")
    return ('@deprecated("%s")\n' % deprecation(loss) if loss.name in TILED else "") + text


def _method(name: str, sig: inspect.Signature) -> str:
    """A method's declaration; annotations are the source's strings (modules.py
    postpones them)."""
    parts, star = [], False
    for p in sig.parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        part = p.name if p.annotation is p.empty else "%s: %s" % (p.name, p.annotation)
        parts.append(part + ("" if p.default is p.empty else " = ..."))
    returns = "None" if name == "__init__" else sig.return_annotation
    return _wrap("    def %s(" % name, parts, ") -> %s: ..." % returns, "        ")


def module(cls: type) -> str:
    """A loss Module's declaration: its own attributes (annotated in its class),
    its loss's options, its constructor and its public methods."""
    attributes = {**inspect.get_annotations(cls), **{p.name: annotation(p) for p in _signatures.options(cls._loss)}}
    lines = ["class %s(torch.nn.Module):" % cls.__name__]
    lines += ["    %s: %s" % item for item in attributes.items()]
    methods = ["__init__"] + [name for name, value in vars(cls).items()
                              if inspect.isfunction(value) and not name.startswith("_")]
    lines += [_method(name, inspect.signature(getattr(cls, name))) for name in methods]
    return "\n".join(lines)


def blocks() -> str:
    """Both generated blocks of ``__init__.pyi``, as it holds them."""
    losses = (*_signatures.LOSSES.values(), *TILED.values())
    return "\n\n".join([*map(function, losses), *map(module, (ClipLoss, NTXentLoss, MoCoV3Loss, SigLIPLoss,
                                                                GroupedLoss))])


if __name__ == "__main__":
    print(blocks())
