"""Waiting in async tests for a condition that another task or process makes true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``pred`` every 20 ms until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
