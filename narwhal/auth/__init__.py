"""Clients on the data plane: keys, per-tenant limits and priority classes.

A client presents ``Authorization: Bearer KEY``; the keys file (``[auth] keys_file``) holds each key's sha256 and
its tenant's name, allowed models, priority class and limits (``keys``). Each tenant's requests, tokens and
concurrency are counted in token buckets refilled continuously (``limits``), and when the data pool is saturated
the priority classes decide who is admitted first, fairly between tenants of one class (``priority``).
"""
