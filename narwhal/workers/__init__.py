"""Data-plane worker processes under one controller (``serving.workers``).

``protocol`` holds the messages and their framing, ``link`` carries them (over
a local socket between processes, or in memory with one worker), ``view`` is
what the request path of a worker reads and writes, ``controller`` applies what
workers report and publishes snapshots, ``process`` starts and restarts workers.
"""
