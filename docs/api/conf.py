"""Sphinx configuration of Contrax's API reference (built by tools/docs.sh).

One site for both APIs: the public C++ headers through Doxygen's XML and
breathe, the Python package through autodoc (its docstrings). tools/docs.sh
runs Doxygen first and puts the built package on sys.path.
"""
import os

import breathe.directives.file as _breathe_file
from breathe import parser as _breathe_parser
from breathe import renderer as _breathe_renderer

project = "Contrax"
extensions = ["breathe", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.coverage"]
breathe_projects = {"contrax": os.environ["CONTRAX_DOXYGEN_XML"]}
breathe_default_project = "contrax"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_mock_imports = []
# The integrations' docstrings list the peer library's arguments and Contrax's
# own keyword-only ones in sections of their own, rendered as parameters.
napoleon_custom_sections = [
    ("Arguments of open_clip", "params_style"),
    ("Arguments of lightly", "params_style"),
    ("Arguments of sentence_transformers", "params_style"),
    ("Contrax keyword arguments", "params_style"),
]
# `-b coverage` (tools/docs.sh's third step): each public function, class or
# method the site leaves out (it has no docstring) is a warning, so with -W a
# failure. text_ids is public for the tests only (not in the module's __all__).
coverage_show_missing_items = True
coverage_statistics_to_stdout = False
coverage_ignore_pyobjects = [r"contrax\.integrations\.sentence_transformers\.text_ids$"]
html_theme = "alabaster"


def _file_finder_filter(filename, d_parser, project_info, index, matches):
    """breathe's finder for `doxygenfile`, matching the file's path.

    breathe 5.1 matches a doxygenfile argument against Doxygen's file names,
    which are base names, so contrax/train/image/eval.h and
    contrax/train/retrieval/eval.h are one name to it ("Found multiple
    matches", breathe-doc/breathe#703). This matches the argument against the
    end of the file's location instead (the Doxyfile strips it to
    contrax/...); a bare base name still matches as breathe's does.
    """
    for c in index.file_compounds:
        if os.path.basename(c.name) != os.path.basename(filename):
            continue
        for cd in d_parser.parse_compound(c.refid, project_info).root.compounddef:
            if cd.kind != _breathe_parser.DoxCompoundKind.file:
                continue
            if _breathe_file.path_matches(cd.location.file if cd.location else c.name, filename):
                matches.append([_breathe_renderer.TaggedNode(None, cd)])


_breathe_file.file_finder_filter = _file_finder_filter
# breathe renders the enclosing namespace (contrax, contrax::train) once per
# doxygenfile directive, and Sphinx's C++ domain reports each repetition as a
# duplicate declaration; every header is listed once, so nothing else is.
suppress_warnings = ["duplicate_declaration.cpp"]
exclude_patterns = ["_build"]
