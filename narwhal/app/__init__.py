"""The quart-trio control app (``/ready``, ``/health``, ``/metrics``, ``/v1/models``) and the admin routes."""
