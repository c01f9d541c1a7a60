"""Functions users plug in by import path ("package.module:function"): reward functions,
multi-turn generate functions."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def load_function(path: str, what: str) -> Callable:
    """'package.module:function' -> the function; errors name `what` (the config field) and the path."""
    mod, _, name = path.partition(":")
    if not mod or not name:
        raise ValueError(f"{what} {path!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {path!r}: cannot load it: {e}") from None
    except Exception as e:  # the module itself failed as it was imported (a SyntaxError, its own error)
        raise ValueError(f"{what} {path!r}: importing {mod} failed: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{what} {path!r} is not a function")
    return fn
