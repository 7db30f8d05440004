"""``python -m narwhal bench``: router overhead and fault handling against a mock fleet."""
