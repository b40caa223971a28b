"""Small helpers shared across processes: loading plugin functions by path."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any


def load_function(path: str, flag: str | None = None) -> Any:
    """Load an attribute named by a `*-path` flag.

    Accepted forms: `pkg.mod.fn` (dotted import path, modules in the working directory included),
    `file.py` (the attribute named like the file's stem, as in `--custom-generate-function-path
    custom_generate.py`), `file.py:fn` and `pkg.mod:fn`. Errors name the flag, the path and what exists.
    """
    where = f"{flag}={path}" if flag else path
    module_part, attr = _split(path)
    try:
        module = _import(module_part)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise ImportError(f"{where}: cannot import '{module_part}': {type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AttributeError(f"{where}: '{module_part}' has no attribute '{attr}' (callables there: {public})")
    return getattr(module, attr)


def _split(path: str) -> tuple[str, str]:
    if ":" in path:
        module_part, attr = path.rsplit(":", 1)
        return module_part, attr
    if path.endswith(".py"):
        return path, os.path.splitext(os.path.basename(path))[0]
    if "." not in path:
        raise ValueError(f"'{path}' is not a dotted path (pkg.module.function), a file.py or file.py:function")
    module_part, attr = path.rsplit(".", 1)
    return module_part, attr


def _import(module_part: str):
    if module_part.endswith(".py"):
        file = os.path.abspath(module_part)
        if not os.path.exists(file):
            raise FileNotFoundError(file)
        name = "_slime_plugin_" + os.path.splitext(os.path.basename(file))[0]
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == file:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_part)
