"""The audit log: one INFO line per state change, each carrying the call's
principal and request id (added by logs.py's filter).

Two loggers, so an operator can keep one and drop the other (--audit-log):
`bots_server.audit` for experiments (created, forked, restored, deleted,
tasks added) and `bots_server.audit.steps` for training steps (batch
selected, report applied), a line each per step.
"""

from __future__ import annotations

import logging

experiments = logging.getLogger("bots_server.audit")
steps = logging.getLogger("bots_server.audit.steps")
