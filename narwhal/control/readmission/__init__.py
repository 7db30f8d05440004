"""Readmission: the checks an engine must pass to return to placement, when they run, and drains.

``readmitter`` runs the chain and the operator's drains (the shell), ``schedule`` decides when an
out engine is next tried (pure), ``recheck`` is the fast health check of out engines between monitor
passes, ``model`` the chain's checks and the results others read.
"""

from narwhal.control.readmission.model import CHAIN, Check, ReadmissionResult, ReadmissionState
from narwhal.control.readmission.readmitter import Readmitter

__all__ = ["CHAIN", "Check", "ReadmissionResult", "ReadmissionState", "Readmitter"]
