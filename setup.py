"""The one compiled part of Narwhal: the OTLP span encoder (narwhal/tracing/_otlp_native.c).

Optional: where it cannot be built (no C compiler), the install goes on and narwhal/tracing/otlp.py's own encoder
runs, byte for byte the same. Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("narwhal.tracing._otlp_native", ["narwhal/tracing/_otlp_native.c"], optional=True)])
