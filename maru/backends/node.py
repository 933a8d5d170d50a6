"""The maru stores found on this node (`maru pool list|gc`): what each is, who holds
it, and whether it looks leaked, that is held by no process.

A pool in shared memory outlives its processes by design (the next engine finds its
KV there), so a pool nobody holds is not removed on sight: `maru pool gc` removes one
only once it is older than a grace period, and never a store that is kept across
restarts by design (a disk store) or one this user cannot prove unheld.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maru.backends.holders import Holder


@dataclass
class FoundStore:
    """A store found on this node, read without opening it as a store."""

    backend: str
    name: str
    path: str
    owner: str
    created: float | None = None
    """Seconds since the epoch."""
    capacity: int | None = None
    used: int | None = None
    objects: int | None = None
    held: bool | None = None
    """Whether any process holds it open (its own holder record); None: cannot tell."""
    holders: list[Holder] = field(default_factory=list)
    """The processes holding it that this user can see."""
    why_unknown: str = ""
    """Why `held` is None."""
    kept_by_design: str = ""
    """Why `maru pool gc` never removes it, if it never does."""
    problem: str = ""
    """What is wrong with it, if anything (not a maru pool, another format version)."""
    remove: Callable[[], str] | None = field(default=None, repr=False, compare=False)
    """Removes it unless someone holds it by now; returns why it was kept, or ""."""

    @property
    def leaked(self) -> bool:
        """Held by no process, and not a store that is kept without one."""
        return not self.kept_by_design and self.held is False and not self.holders

    def keep_reason(self, older_than: float, now: float | None = None) -> str:
        """Why `maru pool gc --older-than SECONDS` keeps it; "" if it removes it."""
        if self.kept_by_design:
            return self.kept_by_design
        if self.holders:
            return "held by " + ", ".join(str(h) for h in self.holders)
        if self.held:
            return "held by a process of another user (this user cannot see which)"
        if self.held is None:
            return f"cannot tell whether it is held: {self.why_unknown}"
        age = (now or time.time()) - (self.created or 0)
        if age < older_than:
            return f"held by no process, but only {age:.0f} s old (younger than {older_than:g} s)"
        return ""

    def as_dict(self) -> dict[str, Any]:
        """For `--json`."""
        return {
            "backend": self.backend,
            "name": self.name,
            "path": self.path,
            "owner": self.owner,
            "capacity": self.capacity,
            "used": self.used,
            "objects": self.objects,
            "created": self.created,
            "held": self.held,
            "holders": [vars(h) for h in self.holders],
            "leaked": self.leaked,
            "kept_by_design": self.kept_by_design or None,
            "problem": self.problem or None,
        }
