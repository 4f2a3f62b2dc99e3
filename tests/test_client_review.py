"""kvfence.client: arguments the wire cannot carry are refused as InvalidArgument (and the generate
CLI says so in one line), and the client channels keep their connection alive with pings the
servers accept."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

# The fake nodes and the cluster harness live with the control-plane tests.
sys.path.insert(0, str(Path(__file__).parent / "control_plane"))
from cp_fakes import script_tokens
from cp_harness import Cluster, make_cluster

from control_plane import admission
from kvfence import server as kvserver
from kvfence.client import AsyncClient, Client, build_request
from kvfence.errors import InvalidArgument

KVFENCE = str(Path(sys.executable).with_name("kvfence"))


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    structlog.reset_defaults()
    c = await make_cluster(tmp_path)
    yield c
    await c.close()


# -- build_request -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 2**32}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"prompt": None, "prompt_ids": [5, -1]}, "prompt_ids[1]"),
        ({"prompt": None, "prompt_ids": [2**32]}, "prompt_ids[0]"),
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"stop": ["ok", "\udcff"]}, "stop[1]"),  # undecodable argv bytes (surrogateescape)
        ({"model": "m\ud800"}, "model"),
    ],
)
def test_build_request_refuses_what_the_wire_cannot_carry(
    kwargs: dict[str, Any], field: str
) -> None:
    """These raised protobuf's ValueError or UnicodeEncodeError, not a kvfence error as the
    module promises."""
    args: dict[str, Any] = {"prompt": "hi", "prompt_ids": None, "max_new_tokens": 4, **kwargs}
    with pytest.raises(InvalidArgument) as err:
        build_request(args.pop("prompt"), args.pop("prompt_ids"), **args)
    assert err.value.reason == admission.INVALID_PARAMETERS  # the control plane's own reason
    assert err.value.message.startswith(field + " ")
    err.value.message.encode("ascii")  # printable anywhere, and no prompt text in it


def test_build_request_takes_the_limits_of_each_field() -> None:
    """Control: the edges of each range and non-ASCII text build, and arrive as given."""
    req = build_request(
        "héllo ✓",
        None,
        max_new_tokens=2**32 - 1,
        seed=2**64 - 1,
        stop=["é", "\U0001f600"],
        model="m-é",
    )
    assert (req.text, req.max_new_tokens, req.seed) == ("héllo ✓", 2**32 - 1, 2**64 - 1)
    assert list(req.stop) == ["é", "\U0001f600"] and req.model == "m-é"
    req = build_request(None, [0, 2**32 - 1], max_new_tokens=0, seed=0)
    assert list(req.token_ids.ids) == [0, 2**32 - 1] and req.seed == 0 and req.max_new_tokens == 0


async def test_values_at_the_edges_are_served(cluster: Cluster) -> None:
    """Control, end to end: valid values the new checks look at are served."""
    client = cluster.client(timeout=10)
    result = await client.generate(
        "hél", max_new_tokens=4, seed=2**64 - 1, temperature=0.5, stop=["\U0001f600"]
    )
    assert result.usage.completion_tokens == 4 and result.token_ids == script_tokens()[:4]
    result = await client.generate(prompt_ids=[0, 255], max_new_tokens=2, seed=0)
    assert result.finish_reason == "length" and result.usage.prompt_tokens == 2


async def _kvfence(*args: str | bytes) -> tuple[int, str, str]:
    """The installed ``kvfence`` command in a subprocess (its argv as the shell passes it: bytes
    that are not UTF-8 arrive as surrogates), while this test's event loop serves the cluster."""
    env = {**os.environ, "KVFENCE_API_KEY": "", "PYTHONUTF8": "0"}
    proc = await asyncio.create_subprocess_exec(
        KVFENCE,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_generate_reports_text_that_is_not_utf8_in_one_line(cluster: Cluster) -> None:
    """``kvfence generate --stop $'\\xff'`` printed a UnicodeEncodeError traceback; it prints one
    line and exits 2, as its docstring says. Control: a valid non-ASCII stop string is served."""
    base = ["generate", "--target", cluster.target, "--api-key", cluster.api_key, "-n", "4"]
    code, out, err = await _kvfence(*base, "--stop", b"\xff", "hello")
    assert code == 2, err
    assert err.splitlines() == [
        "INVALID_ARGUMENT: stop[0] is not valid UTF-8 text (character 0 is a lone surrogate)"
    ]
    assert out == ""
    code, out, err = await _kvfence(*base, "--stop", "é", "hello")
    assert code == 0, err
    assert out.endswith("\n") and len(out) > 1


# -- keepalive -----------------------------------------------------------------------------------


async def test_client_channels_are_created_with_keepalive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Client and AsyncClient (insecure and TLS) open their channels with keepalive pings, which
    the servers accept as often: a connection lost silently ends a call instead of hanging it."""
    seen: list[dict[str, Any]] = []

    def spy(real: Any) -> Any:
        def make(*args: Any, options: Any = None, **kwargs: Any) -> Any:
            seen.append(dict(options))
            return real(*args, options=options, **kwargs)

        return make

    for module in (grpc, grpc.aio):
        for name in ("insecure_channel", "secure_channel"):
            monkeypatch.setattr(module, name, spy(getattr(module, name)))
    Client("127.0.0.1:1", "k").close()
    await AsyncClient("127.0.0.1:1", "k").close()  # nothing connects
    # With TLS (credentials are only read when a connection is made).
    Client("127.0.0.1:1", "k", tls_ca=b"CA", tls_server_name="cp").close()
    await AsyncClient("127.0.0.1:1", "k", tls_ca=b"CA").close()
    assert len(seen) == 4
    assert seen[2]["grpc.ssl_target_name_override"] == "cp"
    for options in seen:
        assert options["grpc.keepalive_time_ms"] == kvserver.KEEPALIVE_TIME_MS
        assert options["grpc.keepalive_timeout_ms"] == kvserver.KEEPALIVE_TIMEOUT_MS
        assert options["grpc.http2.max_pings_without_data"] == 0
        assert options["grpc.max_receive_message_length"] == kvserver.MAX_MESSAGE_BYTES
    server = dict(kvserver.server_options())
    permitted = server["grpc.http2.min_ping_interval_without_data_ms"]
    assert permitted <= kvserver.KEEPALIVE_TIME_MS / 2  # room for timer jitter
    assert server["grpc.so_reuseport"] == 0


async def test_a_silent_request_is_not_disconnected_for_its_pings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stack smoke, with the intervals scaled down (client pings every 200 ms, which grpc spaces
    to about 1 s; the server accepts one every 100 ms): a request that sends the client nothing
    for 5 s (decode holds its tokens) gets its whole answer. A server left at gRPC's default (a
    ping per 5 min) ends such a call UNAVAILABLE "Too many pings" after about 4 s."""
    monkeypatch.setattr(kvserver, "KEEPALIVE_TIME_MS", 200)
    monkeypatch.setattr(kvserver, "KEEPALIVE_TIMEOUT_MS", 2000)
    monkeypatch.setattr(kvserver, "MIN_PING_INTERVAL_MS", 100)
    structlog.reset_defaults()
    c = await make_cluster(tmp_path)
    try:
        c.script.decode_hold = asyncio.Event()
        asyncio.get_running_loop().call_later(5.0, c.script.decode_hold.set)
        t0 = time.monotonic()
        result = await c.client(timeout=30).generate(prompt_ids=[10, 11], max_new_tokens=4)
        assert time.monotonic() - t0 > 4.5  # it was held (silent) that long
        assert result.token_ids == script_tokens()[:4] and result.finish_reason == "length"
    finally:
        if c.script.decode_hold is not None:
            c.script.decode_hold.set()
        await c.close()
