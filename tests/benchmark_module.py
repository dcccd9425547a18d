"""Loads a benchmarks/*.py script as a module for tests, from its file.

Not through sys.path: putting benchmarks/ on it would shadow the `serving` package with benchmarks/serving.py.
The module is registered in sys.modules under `name` while it loads (dataclasses look their module up there).
"""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_benchmark(script: str, name: str):
    """benchmarks/<script> as a module called `name` (left in sys.modules; `forget` removes it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def forget(name: str) -> None:
    sys.modules.pop(name, None)
