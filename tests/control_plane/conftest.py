from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog
from cp_harness import Cluster, make_cluster


@pytest.fixture(autouse=True)
def _default_structlog() -> Iterator[None]:
    """Log through structlog's defaults: a test elsewhere that ran the CLI in-process may have
    configured it to print to a CliRunner stream that is closed by now."""
    structlog.reset_defaults()
    yield


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Control plane (context window 256) with one fake decode and one fake prefill node."""
    c = await make_cluster(tmp_path)
    yield c
    await c.close()
