"""Engines that find the router: what they register, and watching the store for them (issue 36)."""
