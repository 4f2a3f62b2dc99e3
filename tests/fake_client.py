"""A stand-in for ``kvfence.client.Client`` in CLI tests: a subclass says what ``stream`` does,
and the tests patch it in for ``client_mod.Client``, so no server is needed."""

from __future__ import annotations

from typing import Any


class FakeClientBase:
    """Takes any constructor arguments (address, key, TLS) and is its own context manager with a
    ``close``, as the real Client is."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def __enter__(self) -> FakeClientBase:
        return self

    def __exit__(self, *_: Any) -> None:
        pass

    def close(self) -> None:
        pass
