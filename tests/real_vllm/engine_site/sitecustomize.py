"""NIXL's busy-poll cure, loaded only by the tier's vLLM engines (this directory is first on their PYTHONPATH).

nixl's Python API creates its agent with a progress-thread delay of 0 (``pthrDelay = 0``), so each idle engine
spins a whole core, and on 2 cores three engines starve everything else.  This hook wraps ``nixlAgent`` in the
bindings module as it is imported and sets the delay to ``$NARWHAL_NIXL_PROGRESS_DELAY_US`` microseconds (2 ms
by default): idle CPU drops to well under 1% and transfers still work.  Turning the progress thread off instead
makes the decode engine's read hang.  Nothing else is touched; without nixl this does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_TARGETS = {"nixl_cu12._bindings", "nixl_cu13._bindings", "nixl_rocm._bindings"}


def _patch(module: object) -> None:
    delay_us = int(os.environ.get("NARWHAL_NIXL_PROGRESS_DELAY_US", "2000"))
    original = getattr(module, "nixlAgent", None)
    if original is None or getattr(original, "_narwhal_patched", False):
        return

    def nixl_agent(name, config, *args, **kwargs):  # type: ignore[no-untyped-def]
        if getattr(config, "useProgThread", False):
            config.pthrDelay = delay_us
        return original(name, config, *args, **kwargs)

    nixl_agent._narwhal_patched = True  # type: ignore[attr-defined]
    module.nixlAgent = nixl_agent  # type: ignore[attr-defined]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("NARWHAL_NIXL_PROGRESS_DELAY_US", "") != "0":
    sys.meta_path.insert(0, _PatchOnImport())
