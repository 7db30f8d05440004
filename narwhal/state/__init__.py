"""Durable control-plane state: the versioned handoff document and ``--resume``."""
