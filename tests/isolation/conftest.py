"""The isolation suites start their stacks with tests/stack's helpers (``stack_starts``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stack"))
