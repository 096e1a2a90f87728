"""A state machine driven in memory the way the server's apply path drives it, keeping the
records it applied so that a test can replay them into a fresh machine (the replay rule:
the same records give the same state). Shared by the core tests of the fleet and of job
policies; core/ is pure, so these run with no server and no clock but the ``now`` given."""

from __future__ import annotations

from typing import Any

from rdzv_client.record import JobSettings
from rdzv_server.core import command as c
from rdzv_server.core.machine import StateMachine


class MachineLog:
    """A machine plus the records it applied. ``job`` is the job its helpers name by default."""

    def __init__(self, job: str = "job") -> None:
        self.job = job
        self.sm = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        self.records: list[dict[str, Any]] = []

    def apply(self, command: c.Command, now: float) -> dict[str, Any]:
        result = self.sm.apply(command, now).result
        self.records.append({"cmd": command.to_record(), "now": now, "rid": None})
        return result

    def join(
        self, node: str, now: float, *, addr: str = "", host: str = "", job: str | None = None, **settings: Any
    ) -> int:
        """``node`` joins (2 nodes, a 5 s last call, unless ``settings`` say otherwise): its round."""
        s = JobSettings(**{"min_nodes": 2, "max_nodes": 2, "last_call_timeout": 5.0, **settings})
        return int(self.apply(c.Join(job or self.job, node, addr or f"{node}.host", 1, s, host=host), now)["round"])

    def events(self, job: str | None = None) -> list[tuple[str, str, str | None]]:
        return [(e.kind.value, e.cause.value, e.node_id) for e in self.sm.job(job or self.job).timeline.since(0)]

    def replayed(self) -> StateMachine:
        fresh = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        for record in self.records:
            fresh.replay(record)
        return fresh
