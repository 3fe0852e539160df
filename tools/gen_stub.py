"""The generated parts of python/contrax/__init__.pyi: the losses' functions,
from their table (``_signatures.LOSSES``), and the losses'
Modules, from the classes themselves (their options come from the same table).
A development tool, not shipped with the package (as PyTorch keeps its stub
generator in its tools/):

  PYTHONPATH=build/python .venv/bin/python tools/gen_stub.py

prints both blocks; python/tests/test_signatures.py fails when
``__init__.pyi`` does not hold them, so adding a parameter is an edit of the
table and a paste of this output.
"""
import inspect
from typing import Dict, Iterable, List

import torch

from contrax import _signatures
from contrax._signatures import REQUIRED, Loss, annotation
from contrax.modules import ClipLoss, GroupedLoss, MaxSimLoss, MoCoV3Loss, NTXentLoss, SigLIPLoss

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
    """The loss's declaration."""
    params = ["%s: %s%s" % (p.name, annotation(p), "" if p.default is REQUIRED else " = ...") for p in loss.params]
    params.insert(loss.positional, "*")
    return _wrap("def %s(" % loss.name, params, ") -> torch.Tensor: ...", "    ")


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


_MODULES = (ClipLoss, NTXentLoss, MoCoV3Loss, SigLIPLoss, GroupedLoss, MaxSimLoss)


def _attributes(cls: type) -> Dict[str, str]:
    """The attributes a loss Module has: its own annotated ones and its loss's
    options; those a base of several has: the options all of its losses share."""
    if cls is torch.nn.Module:
        return {}
    options = [{p.name: annotation(p) for p in _signatures.options(m._loss)} for m in _MODULES if issubclass(m, cls)]
    shared = {k: v for k, v in options[0].items() if all(k in o for o in options)}
    own = vars(cls).get("__annotations__", {})  # inspect.get_annotations(cls) from Python 3.10
    return {**own, **shared} if cls in _MODULES else shared


def module(cls: type) -> str:
    """A loss Module's declaration, or its base's: the attributes its stub base
    does not declare, then (a loss's Module) its constructor and public methods."""
    parent = cls.__bases__[0]
    lines = ["class %s(%s):" % (cls.__name__, "torch.nn.Module" if parent is torch.nn.Module else parent.__name__)]
    lines += ["    %s: %s" % item for item in _attributes(cls).items() if item[0] not in _attributes(parent)]
    if cls in _MODULES:
        methods = ["__init__"] + [name for name, value in vars(cls).items()
                                  if inspect.isfunction(value) and not name.startswith("_")]
        lines += [_method(name, inspect.signature(getattr(cls, name))) for name in methods]
    return "\n".join(lines)


def blocks() -> str:
    """Both generated blocks of ``__init__.pyi``, as it holds them (each base
    of the Modules before the first that derives from it)."""
    classes: List[type] = []
    for m in _MODULES:
        classes += [c for c in reversed(m.__mro__[:m.__mro__.index(torch.nn.Module)]) if c not in classes]
    return "\n\n".join([*map(function, _signatures.LOSSES.values()), *map(module, classes)])


if __name__ == "__main__":
    print(blocks())
