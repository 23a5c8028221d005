"""The benchmark scripts as modules, for their tests: bench/ sits beside the package, not in it."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).parents[1]


def load(name: str):
    """``bench/<name>.py`` as the module ``bench_<name>``, loaded once. It is registered before it
    runs: dataclasses look their module up while the file runs."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
