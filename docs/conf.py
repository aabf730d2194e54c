"""Sphinx configuration: the contract, the architecture and the API reference (autodoc
over the docstrings, pages in Markdown through MyST).

Build: `sphinx-build -W -b html docs docs/_build/html` (warnings are errors; CI builds it).
Imports the package from this checkout, so its dependencies (jax) must be installed.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "jax_kvalloc"
author = "the jax_kvalloc authors"
copyright = "the jax_kvalloc authors, Apache-2.0"  # pylint: disable=redefined-builtin
release = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# Docstrings use Google-style sections (Args:, Returns:, Attributes:).
napoleon_numpy_docstring = False
napoleon_use_rtype = False
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

# The docstrings are plain prose with `code` in single backticks.
default_role = "code"
autodoc_default_options = {"members": True, "show-inheritance": True,
                           "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

html_theme = "alabaster"
html_title = "jax_kvalloc"
