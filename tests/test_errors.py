"""Every exception Narwhal defines derives from ``NarwhalError``, and the public ones are in the drawn tree."""

from __future__ import annotations

import importlib
import inspect

import narwhal.errors
from narwhal.errors import EngineFailure, FailureClass, NarwhalError, PoolSaturated, UpstreamClientError
from tests.test_layout import all_modules


def narwhal_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in a narwhal module, by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for name in all_modules():
        module = importlib.import_module(name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{value.__qualname__}"] = value
    return found


def test_every_project_exception_derives_from_the_root() -> None:
    exceptions = narwhal_exceptions()
    # The known ones are found (the walk must be able to see a stray class).
    assert {"narwhal.config.ConfigError", "narwhal.errors.EngineFailure", "narwhal.state.handoff.HandoffError",
            "narwhal.http1.client.HTTPTransportError", "narwhal.serving.request_core.ClientError"} <= set(exceptions)
    strays = sorted(name for name, cls in exceptions.items() if not issubclass(cls, NarwhalError))
    assert strays == []


def test_the_docstring_draws_every_public_exception() -> None:
    tree = narwhal.errors.__doc__ or ""
    public = {cls.__name__ for cls in narwhal_exceptions().values() if not cls.__name__.startswith("_")}
    missing = sorted(name for name in public if name not in tree)
    assert missing == []


def test_the_root_catches_engine_and_pool_errors() -> None:
    for exc in (EngineFailure("d1", FailureClass.TIMEOUT, "slow"), UpstreamClientError("d1", 400, b"{}"),
                PoolSaturated("data pool full")):
        try:
            raise exc
        except NarwhalError as caught:
            assert caught is exc
