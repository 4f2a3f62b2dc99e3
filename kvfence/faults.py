"""Test-only fault hook in the prefill -> decode transfer path.

Off unless the node's config sets ``node.fault_hook: true`` and ``node.fault_file``; nothing on the
public API can reach it. Tests write a JSON list to the fault file; before each transfer prefill
reads
it and applies the first fault whose ``tenant_id`` matches the request (or that names no tenant)::

    [{"kind": "corrupt_byte", "tenant_id": "tenant-b"}]

Kinds (each must make the affected request fail, never succeed with wrong data):

==================  ====================================================================
drop_page           the last prompt page is never sent
duplicate_page      page 0 is sent twice
reorder_pages       pages 0 and 1 are sent to each other's index
truncate_pages      the manifest lists one page fewer
fewer_tokens        the manifest claims one token fewer than the prompt
corrupt_byte        one byte of page 0 is flipped on the wire (prefill's own page is intact)
stale_generation    the manifest names page 0 at the generation before the reserved one
foreign_page        the manifest names a page of another reservation in place of page 0
replay              the transfer runs twice (the second is a replay)
wrong_mac           the MAC is computed under another key
bad_auth            the UCX hello carries a wrong authenticator
kill                the prefill process exits after sending the first batch
delay               prefill stalls ``seconds`` after the hello (transfer timeout)
==================  ====================================================================
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

KINDS = frozenset(
    {
        "drop_page",
        "duplicate_page",
        "reorder_pages",
        "truncate_pages",
        "fewer_tokens",
        "corrupt_byte",
        "stale_generation",
        "foreign_page",
        "replay",
        "wrong_mac",
        "bad_auth",
        "kill",
        "delay",
    }
)


@dataclass(frozen=True)
class Fault:
    kind: str
    tenant_id: str | None = None
    seconds: float = 0.0


class FaultHook:
    """Reads the fault file on every transfer (so a test can change it while the node runs)."""

    def __init__(self, path: Path | None):
        self.path = path

    def fault_for(self, tenant_id: str) -> Fault | None:
        if self.path is None or not self.path.exists():
            return None
        entries = json.loads(self.path.read_text() or "[]")
        for entry in entries:
            fault = Fault(
                kind=entry["kind"],
                tenant_id=entry.get("tenant_id"),
                seconds=float(entry.get("seconds", 0.0)),
            )
            if fault.kind not in KINDS:
                raise ValueError(f"unknown fault kind {fault.kind!r}")
            if fault.tenant_id in (None, tenant_id):
                return fault
        return None
