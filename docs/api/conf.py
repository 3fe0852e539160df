"""Sphinx configuration of Contrax's API reference (built by tools/docs.sh).

One site for both APIs: the public C++ headers through Doxygen's XML and
breathe, the Python package through autodoc (its docstrings). tools/docs.sh
runs Doxygen first and puts the built package on sys.path.
"""
import os

project = "Contrax"
extensions = ["breathe", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.coverage"]
breathe_projects = {"contrax": os.environ["CONTRAX_DOXYGEN_XML"]}
breathe_default_project = "contrax"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_mock_imports = []
coverage_show_missing_items = True
html_theme = "alabaster"
exclude_patterns = ["_build"]
