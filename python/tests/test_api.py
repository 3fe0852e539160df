"""Every public function has a docstring and a signature in the type stub."""
import ast
import os

import contrax


def test_docstrings_and_stub():
    stub_path = os.path.join(os.path.dirname(contrax.__file__), "__init__.pyi")
    tree = ast.parse(open(stub_path).read())
    in_stub = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name in contrax.__all__:
        fn = getattr(contrax, name)
        assert fn.__doc__ and len(fn.__doc__.strip()) > 20, name
        assert name in in_stub, name
