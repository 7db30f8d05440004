"""Readmission stage: start the re-probes the fleet has scheduled, then any readmission that is due.

An inconclusive inference probe leaves its hold and a next probe time in the
fleet; this stage starts those probes once due. The readmission chain itself
(identity, attestation, generation) is the optional ``readmission`` object's
``readmit_due()``.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["ReadmissionStage", "Readmission"]


class _Supervisor(Protocol):
    def start_due_probes(self) -> None: ...


class Readmission(Protocol):
    """The readmission chain as this stage runs it (``narwhal.control.readmission.Readmitter``)."""

    async def readmit_due(self) -> None: ...


class ReadmissionStage:
    """Starts due inference re-probes and, when given, runs ``readmission.readmit_due()``."""

    name = "readmission"

    def __init__(self, *, supervisor: _Supervisor, readmission: Readmission | None = None) -> None:
        self.supervisor = supervisor
        self.readmission = readmission

    async def run(self, pass_number: int) -> None:
        """Probes first (they are started in the supervisor's nursery and return at once)."""
        self.supervisor.start_due_probes()
        if self.readmission is not None:
            await self.readmission.readmit_due()
