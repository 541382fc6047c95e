"""Runs an action once the program has imported a module: at once if it is loaded, else from a
finder on sys.meta_path that wraps the module's loader (so that mpidist never imports the module
itself for the action's sake)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys


def after_import(name: str, action) -> None:
    """action() now if the module `name` is loaded, else once the program has imported it; an
    action already waiting for that module is not added twice."""
    if sys.modules.get(name) is not None:
        action()
    elif not any(isinstance(finder, _AfterImport) and (finder.name, finder.action) == (name, action)
                 for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, action))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the module `name` through the other finders and runs `action` once it has run."""

    def __init__(self, name: str, action):
        self.name, self.action = name, action

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            self.action()

        spec.loader.exec_module = exec_module
        return spec
