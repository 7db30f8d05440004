"""Several routers serving at once (``[lease] mode = "replicas"``): the controller's fleet view shared through etcd."""
