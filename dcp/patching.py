"""Patch a framework's module when it is imported, not before: the plugins (``dcp.vllm_plugin``,
``dcp.sglang_plugin``) load in every process of a serving engine, and importing a heavy module
there only to patch it would slow the start-up of processes that never use it."""

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Callable

_patches: dict = {}  # module name -> the patches to apply each time it executes


def when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` on the module ``name``: now if it is loaded, and again each time it is
    (re)imported from the file system, right after it executes. ``patch`` must be idempotent."""
    hooks = _patches.setdefault(name, [])
    if patch not in hooks:
        hooks.append(patch)
    if name in sys.modules:
        patch(sys.modules[name])
    if not any(type(f).__name__ == "_PatchingFinder" for f in sys.meta_path):  # (one, even after a reload)
        sys.meta_path.insert(0, _PatchingFinder())


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """The file system's spec for a module that has patches, its loader wrapped for that one module.
    (A module found some other way loads unpatched; each plugin says what happens then.)"""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        for patch in _patches.get(module.__name__, ()):
            patch(module)

    def __getattr__(self, name):  # get_source, get_code, ... as the wrapped loader has them
        return getattr(self.loader, name)

