"""Narwhal's compiled parts: the relay pump's usual read (narwhal/http1/_relay_native.c), and on a traced
request's path the OTLP span encoder (narwhal/tracing/_otlp_native.c) and RequestTrace
(narwhal/tracing/_spans_native.c).

Optional: where they cannot be built (no C compiler), the install goes on and the Python twins in
narwhal/http1/pump.py and narwhal/tracing/otlp.py and spans.py run, with the same results. Everything else
about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("narwhal.tracing._otlp_native", ["narwhal/tracing/_otlp_native.c"], optional=True),
    Extension("narwhal.tracing._spans_native", ["narwhal/tracing/_spans_native.c"], depends=["narwhal/_slot_offset.h"],
              optional=True),
    Extension("narwhal.http1._relay_native", ["narwhal/http1/_relay_native.c"], depends=["narwhal/_slot_offset.h"],
              optional=True),
])
