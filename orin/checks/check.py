"""One pass/fail/skip line of a report, shared by `orin-omni smoke` (the service end to end) and `orin-omni doctor`
(the board): the same statuses and the same record, so scripts read both reports alike."""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP: a skip is no failure
    detail: str
    fix: str = ""  # what to run or change when it failed

    def to_json(self) -> dict:
        """Smoke's JSON line: `fix` only where there is one (doctor reports every field)."""
        out = {"name": self.name, "status": self.status, "detail": self.detail}
        return {**out, "fix": self.fix} if self.fix else out
