"""Every face of a loss agrees with its one declaration (contrax/_signatures.py):
the public function (its code's parameters, signature and docstring), the
binding's function (python/src/bind_losses.cpp), the C++ options' defaults,
the operators' schemas, the type stub and the nn.Module's constructor; the
names removed after their deprecation (``chunk_size``, ``tiled_*``) are gone."""
import importlib.util
import inspect
import os
import re

import pytest
import torch

import contrax
from contrax import _signatures as table


def _load_stub_generator():
    """tools/gen_stub.py: the stub's generator, a development tool outside the package."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tools", "gen_stub.py")
    spec = importlib.util.spec_from_file_location("gen_stub", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_stub = _load_stub_generator()

LOSSES = list(table.LOSSES.values())
FUNCTIONS = LOSSES
MODULES = {"clip_loss": contrax.ClipLoss, "grouped_loss": contrax.GroupedLoss, "nt_xent_loss": contrax.NTXentLoss,
           "moco_v3_loss": contrax.MoCoV3Loss, "siglip_loss": contrax.SigLIPLoss,
           "maxsim_loss": contrax.MaxSimLoss}
SCHEMA_TYPES = {"Tensor": "Tensor", "Tensor?": "Optional[Tensor]", "bool": "bool", "float": "float", "int": "int",
                "str": "str", "group": "str"}


def _names(loss):
    return [p.name for p in loss.params]


@pytest.mark.parametrize("loss", FUNCTIONS, ids=lambda x: x.name)
def test_function_has_the_tables_parameters(loss):
    fn = getattr(contrax, loss.name)
    code = fn.__code__
    assert list(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]) == _names(loss)
    assert code.co_argcount == loss.positional
    defaults = {**dict(zip(code.co_varnames[code.co_argcount - len(fn.__defaults__ or ()):code.co_argcount],
                           fn.__defaults__ or ())), **(fn.__kwdefaults__ or {})}
    assert defaults == {p.name: p.default for p in loss.params if p.default is not table.REQUIRED}
    assert inspect.signature(fn) == table.signature(loss)
    args = fn.__doc__.split("Args:")[1].split("Returns:")[0]
    assert re.findall(r"^    (\w+(?:, \w+)*):", args, re.M) and \
        [n for line in re.findall(r"^    (\w+(?:, \w+)*):", args, re.M) for n in line.split(", ")] == _names(loss)
    with pytest.raises(TypeError):  # the options are keyword-only
        fn(*([None] * (loss.positional + 1)))
    # It reads no global: torch 2.6's Dynamo guards an inlined function's
    # globals as attributes of its module (``contrax._impl``), which broke
    # every compiled step there when the call went through one.
    assert code.co_names == () and fn.__closure__


@pytest.mark.parametrize("loss", LOSSES, ids=lambda x: x.name)
def test_binding_takes_the_tables_order(loss):
    # pybind11's docstring opens with the function's signature.
    first = getattr(contrax._contrax, loss.name).__doc__.strip().splitlines()[0]
    got = re.findall(r"(\w+): ", first[first.index("(") + 1:])
    assert got == ["comm" if n == "group" else n for n in _names(loss)]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda x: x.name)
def test_defaults_are_the_cpp_options_defaults(loss):
    # The binding reports each loss's default-constructed C++ options
    # (include/contrax/losses/*.h) in the table's words: every option the
    # table gives a default but the group (None: the default group, which
    # C++ spells as no communicator), with its value and its type.
    cpp = contrax._contrax._option_defaults()
    assert sorted(cpp) == sorted(table.LOSSES)
    want = {p.name: p.default for p in table.options(loss) if p.type != "group"}
    assert cpp[loss.name] == want
    assert {k: type(v) for k, v in cpp[loss.name].items()} == {k: type(v) for k, v in want.items()}


def _stub_text():
    return open(os.path.join(os.path.dirname(contrax.__file__), "__init__.pyi")).read()


def test_stub_holds_the_generated_block():
    # tools/gen_stub.py prints what __init__.pyi must hold: the
    # losses' functions and their Modules, each option annotated from the table.
    assert _stub.blocks() in _stub_text()
    # The options every Module has sit on their base (the memory path and the
    # group), those of the feature-vector losses on theirs.
    assert _stub.module(contrax.modules._LossModule).endswith("    group: Optional[ProcessGroup]")
    assert '    path: Literal["auto", "materialised", "tiled"]\n' in _stub.module(contrax.modules._LossModule)
    assert "    normalize: bool\n" in _stub.module(contrax.modules._FeatureLoss)
    assert "max_logit_scale" not in _stub.module(contrax.NTXentLoss)


@pytest.mark.parametrize("loss", LOSSES, ids=lambda x: x.name)
def test_module_takes_the_tables_options(loss):
    cls = MODULES[loss.name]
    options = table.options(loss)
    params = list(inspect.signature(cls.__init__).parameters.values())[-len(options):]
    assert [(p.name, p.kind, p.default) for p in params] == \
        [(p.name, inspect.Parameter.KEYWORD_ONLY, p.default) for p in options]
    assert [p.annotation for p in params] == [table.annotation(p) for p in options]  # what the stub shows
    assert all(p.name in cls.__doc__.split("Options, as in")[1] for p in options)
    m = cls()
    assert {p.name: getattr(m, p.name) for p in options} == {p.name: p.default for p in options}
    shown = repr(m)
    assert all(f"{p.name}={p.default!r}" in shown for p in options if p.name != "group")
    with pytest.raises(TypeError, match="unexpected keyword argument 'tile_sise'"):
        cls(tile_sise=2)


def test_module_passes_its_options_on():
    g = torch.Generator().manual_seed(5)
    z1, z2 = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randn(7, 4, generator=g, dtype=torch.float64)
    m = contrax.NTXentLoss(temperature=0.4, reduction="none", path="tiled", tile_size=3)
    assert torch.equal(m(z1, z2), contrax.nt_xent_loss(z1, z2, temperature=0.4, reduction="none", path="tiled",
                                                       tile_size=3))
    assert "tile_size=3" in repr(m) and "path='tiled'" in repr(m)


def test_the_names_removed_after_their_release_are_gone():
    # chunk_size (siglip_loss, SigLIPLoss; now tile_size) and the always-tiled
    # tiled_clip_loss & co. (now the loss with path="tiled"): docs/releases.md.
    a, b, s = torch.randn(4, 3), torch.randn(4, 3), torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"siglip_loss\(\) got an unexpected keyword argument 'chunk_size'"):
        contrax.siglip_loss(a, b, s, None, chunk_size=2)
    with pytest.raises(TypeError, match=r"SigLIPLoss\(\) got an unexpected keyword argument 'chunk_size'"):
        contrax.SigLIPLoss(chunk_size=2)
    for name in ("tiled_clip_loss", "tiled_nt_xent_loss", "tiled_moco_v3_loss"):
        assert not hasattr(contrax, name) and name not in contrax.__all__

