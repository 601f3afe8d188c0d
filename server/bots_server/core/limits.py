"""Every bound on what a request may carry, in one place: what the store's
columns and the arithmetic can hold, and what keeps one request small.
docs/design.md lists them; validation.py enforces them."""

from __future__ import annotations

import re

# Strings. None may contain NUL (PostgreSQL's text cannot hold it).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # experiment names
MAX_NAME_LENGTH = 128
# Tenants (core/tenancy.py): a DNS label, so it fits in URLs, metric labels
# and Kubernetes names unchanged.
TENANT_PATTERN = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
MAX_TENANT_LENGTH = 63
# An experiment's name in the store: "tenant/name", or the plain name in the
# default tenant (experiments.name, which holds MAX_NAME_LENGTH characters:
# a tenant's prefix counts against them).
STORED_NAME_PATTERN = re.compile(r"([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?/)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_KEY_LENGTH = 1024  # tasks.key
MAX_REQUEST_KEY_LENGTH = 256  # batches.request_key
MAX_BATCH_ID_LENGTH = 64  # batches.batch_id
MAX_SOURCE_LENGTH = 256  # experiments.forked_from: a stored name or a caller's text
MAX_FEATURE_NAME_LENGTH = 256
MAX_GROUP_NAME_LENGTH = 256  # tasks.group_name
# Groups per experiment: bounds the per-group metric labels and the quota
# arithmetic (datasets mixed in one run are a handful, not hundreds).
MAX_GROUPS = 64
# Reference feature names are read with SQL JSON paths: printable ASCII
# without double quote and backslash.
REFERENCE_FEATURE_PATTERN = re.compile(r'[ !#-\[\]-~]+')

# Numbers.
MAX_SEED = 2**63 - 1  # experiments.seed is a signed 64-bit integer
MAX_STEP = 2**53  # steps stay exact as doubles and far from BIGINT's end
MAX_TRIALS = 2**31 - 1  # outcomes.trials is a signed 32-bit integer
# Leases end at now + TTL: about 317 years keeps that inside every
# timestamp type (Python's ends in year 9999).
MAX_LEASE_TTL_SECONDS = 1e10
MAX_PAGE_SIZE = 1000

# Size of one task.
MAX_FEATURES_PER_TASK = 64
# Values in one task's embedding (float32 each: 16 KiB at the most).
MAX_EMBEDDING_DIM = 4096

# How much of a bad value an error message shows.
SHOWN_CHARACTERS = 64


def shown(value: object) -> str:
    """repr(value), cut to SHOWN_CHARACTERS: error messages name the bad value
    without echoing a megabyte back."""
    text = repr(value)
    if len(text) <= SHOWN_CHARACTERS:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:SHOWN_CHARACTERS]}...{size}"
