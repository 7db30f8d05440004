"""Several routers serving at once (``[lease] mode = "replicas"``): the controller decides, every router serves.

The lease holder is the controller: it runs the fleet rules and publishes each
engine's state to etcd (``publisher``); every other router is a replica that
follows those records (``fleet_view``, ``service``), applies its own
connection failures at once (``control``) and reports its evidence to the
controller over the link (``link``). ``records`` holds what they exchange.
"""
