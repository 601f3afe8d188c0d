"""Audit lines for refused calls: every UNAUTHENTICATED and PERMISSION_DENIED
call is accounted for, without letting a caller that retries in a loop
flood the log.

One WARNING line on `bots_server.audit.denials` per (who, cause) and
interval: the first refusal of a (who, cause) is logged at once, the ones
after it within the interval are counted, and the next line of that key
carries the count (`suppressed`). "who" is the principal (`name@tenant`) or,
for a caller the server does not know, the peer's address without its port;
"cause" is the status and the method. A line never holds a token: the
reasons it quotes are the server's own texts.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("bots_server.audit.denials")

DENIAL_LOG_INTERVAL_S = 60.0
# Keys kept for rate limiting; beyond it the least recently logged go first
# (a scan from many addresses must not grow the server's memory).
MAX_TRACKED = 10_000


@dataclass
class _Seen:
    logged_at: float
    suppressed: int = 0


def peer_host(peer: str) -> str:
    """"ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7" (one key per host, not per connection)."""
    head, sep, port = peer.rpartition(":")
    return head if sep and port.isdigit() else peer


class DenialLog:
    def __init__(
        self,
        interval_s: float = DENIAL_LOG_INTERVAL_S,
        max_tracked: int = MAX_TRACKED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.max_tracked = max_tracked
        self.clock = clock
        self._seen: OrderedDict[tuple[str, str, str], _Seen] = OrderedDict()

    def note(self, who: str, code: str, method: str, reason: str) -> None:
        """A call by `who` to `method` ended with `code` (UNAUTHENTICATED or
        PERMISSION_DENIED) for `reason`."""
        key = (who, code, method)
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.logged_at < self.interval_s:
            seen.suppressed += 1
            return
        suppressed = seen.suppressed if seen is not None else 0
        self._seen[key] = _Seen(logged_at=now)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_tracked:
            self._seen.popitem(last=False)
        log.warning(
            "call denied",
            extra={"who": who, "code": code, "method": method, "reason": reason, "suppressed": suppressed},
        )
