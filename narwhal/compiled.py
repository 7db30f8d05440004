"""The optional compiled modules: each has a Python twin that runs when it was not built or is switched off."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["optional_module"]


def optional_module(name: str) -> ModuleType | None:
    """The compiled module ``name``; None when the install built none (no C compiler there) or
    ``NARWHAL_NO_EXTENSIONS`` is set, and the caller's Python twin runs."""
    if os.environ.get("NARWHAL_NO_EXTENSIONS"):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
