def bind(span_type: type, /) -> bool: ...

# The C RequestTrace's interface is spans.PythonRequestTrace's (spans.py names it RequestTrace for both).
RequestTrace: type
