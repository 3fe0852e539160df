"""Every public function and class has a docstring and a signature in the
type stub; every public method of a public class too, with the same
parameter names as the implementation."""
import ast
import inspect
import os

import contrax


def _stub():
    stub_path = os.path.join(os.path.dirname(contrax.__file__), "__init__.pyi")
    tree = ast.parse(open(stub_path).read())
    names = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names.update({n.target.id: n for n in tree.body if isinstance(n, ast.AnnAssign)})  # constants: `LOCAL: _Local`
    return names


def _stub_params(fn_node, stub=None):
    if isinstance(fn_node, ast.AnnAssign):  # `f: _Protocol`: its __call__'s parameters but self
        call = [n for n in stub[fn_node.annotation.id].body if isinstance(n, ast.FunctionDef) and n.name == "__call__"]
        assert call and len({tuple(_stub_params(n)) for n in call}) == 1
        return _stub_params(call[0])[1:]
    a = fn_node.args
    star = [a.vararg] if a.vararg else []
    starstar = [a.kwarg] if a.kwarg else []
    return [x.arg for x in a.posonlyargs + a.args + star + a.kwonlyargs + starstar]


def test_docstrings_and_stub():
    stub = _stub()
    assert "GradCache" in contrax.__all__ and "clip_loss" in contrax.__all__
    for name in contrax.__all__:
        obj = getattr(contrax, name)
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, name
        assert name in stub, name
        if isinstance(obj, type):
            methods = {n.name: n for n in stub[name].body if isinstance(n, ast.FunctionDef)}
            for attr, member in vars(obj).items():
                if not callable(member) or (attr.startswith("_") and attr not in ("__init__", "__call__")):
                    continue
                assert attr in methods, (name, attr)
                if attr not in ("__init__", "__call__"):  # documented by the class / an alias of step
                    assert member.__doc__ and len(member.__doc__.strip()) > 20, (name, attr)
                params = [p for p in inspect.signature(member).parameters]
                assert _stub_params(methods[attr]) == params, (name, attr)
        elif callable(obj):
            params = list(inspect.signature(obj).parameters)
            assert _stub_params(stub[name], stub) == params, name
