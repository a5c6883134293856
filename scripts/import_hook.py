"""A ``sitecustomize.py`` that patches one module of a cluster's child processes as it is imported.

Test and benchmark hooks use it: put the folder holding the written file on ``PYTHONPATH`` before a cluster starts,
and every child Python process runs ``_patch(module)`` right after its first import of the named module.
"""

from __future__ import annotations

_IMPORT_HOOK = """

import importlib.machinery as _machinery
import sys as _sys


class _PatchOnImport:
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        _sys.meta_path.remove(self)
        spec = _machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


_sys.meta_path.insert(0, _PatchOnImport())
"""


def patch_on_import(module: str, patch_source: str) -> str:
    """The text of a ``sitecustomize.py``: ``patch_source`` defines ``_patch(mod)``, which runs on ``module`` (a
    dotted name) right after that module is first imported; the module is found on ``sys.path`` as usual."""
    return patch_source + _IMPORT_HOOK.replace("MODULE", repr(module))
