"""kvfence.client against a Generate stream that ends OK without its final message (finish reason
and usage): a proxy that cut it, a faulty server. It is Unavailable STREAM_TRUNCATED, as the control
plane treats such a stream from decode, never a result with a made-up finish reason and usage.
The controls: the same server sending its final message gives the whole answer.

The blocking client and the CLI run in a worker thread: the fake server runs on this test's loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
import typer
from typer.testing import CliRunner

from kvfence.cli import generate as generate_cli
from kvfence.client import (
    AsyncClient,
    Client,
    GenerationAccumulator,
    GenerationChunk,
    GenerationResult,
    Usage,
)
from kvfence.errors import Unavailable
from kvfence.proto.kvfence.v1 import client_pb2, client_pb2_grpc, common_pb2

# How the fake ends its stream: "complete" as the control plane does (a final message with the
# held-back text, the finish reason and usage, no tokens); the others end OK without it.
ENDINGS = ("complete", "cut", "silent")


class Ending(client_pb2_grpc.GenerationServicer):
    def __init__(self, ending: str):
        self.ending = ending

    async def Generate(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[client_pb2.GenerateResponse]:
        if self.ending == "silent":
            return
        yield client_pb2.GenerateResponse(request_id="req-1", token_ids=[104, 105], text="hi")
        yield client_pb2.GenerateResponse(request_id="req-1", token_ids=[32, 122], text=" ")
        if self.ending == "complete":
            yield client_pb2.GenerateResponse(
                request_id="req-1",
                text="z",  # held back until the end (it could have begun a stop string)
                finish_reason="length",
                usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=4),
            )


WHOLE = GenerationResult([104, 105, 32, 122], "hi z", "length", Usage(3, 4), "req-1")


@pytest.fixture(params=ENDINGS)
async def server(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str]]:
    """(target, ending) of a fake Generate server."""
    srv = grpc.aio.server()
    client_pb2_grpc.add_GenerationServicer_to_server(Ending(request.param), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}", request.param
    await srv.stop(None)


def check_truncated(err: Unavailable) -> None:
    assert err.reason == "STREAM_TRUNCATED"
    assert "without its final message" in err.message


async def test_sync_generate(server: tuple[str, str]) -> None:
    target, ending = server

    def generate() -> GenerationResult:
        with Client(target, "key", timeout=10) as c:
            return c.generate(prompt_ids=[5, 6, 7], max_new_tokens=4)

    if ending == "complete":
        assert await asyncio.to_thread(generate) == WHOLE
    else:
        with pytest.raises(Unavailable) as err:
            await asyncio.to_thread(generate)
        check_truncated(err.value)


async def test_sync_stream_yields_what_came_then_raises(server: tuple[str, str]) -> None:
    target, ending = server
    got: list[GenerationChunk] = []

    def read() -> None:
        with Client(target, "key", timeout=10) as c:
            for chunk in c.stream(prompt_ids=[5, 6, 7], max_new_tokens=4):
                got.append(chunk)

    if ending == "complete":
        await asyncio.to_thread(read)
        assert "".join(c.text for c in got) == "hi z"
        assert got[-1].token_ids == [] and got[-1].usage == Usage(3, 4)
    else:
        with pytest.raises(Unavailable) as err:
            await asyncio.to_thread(read)
        check_truncated(err.value)
        assert len(got) == (0 if ending == "silent" else 2)  # what arrived was given first


async def test_async_generate_and_stream(server: tuple[str, str]) -> None:
    target, ending = server
    async with AsyncClient(target, "key", timeout=10) as c:
        if ending == "complete":
            assert await c.generate(prompt_ids=[5, 6, 7], max_new_tokens=4) == WHOLE
            chunks = [ch async for ch in c.stream(prompt_ids=[5, 6, 7], max_new_tokens=4)]
            assert chunks[-1].finish_reason == "length"
            return
        with pytest.raises(Unavailable) as err:
            await c.generate(prompt_ids=[5, 6, 7], max_new_tokens=4)
        check_truncated(err.value)
        got: list[GenerationChunk] = []
        with pytest.raises(Unavailable) as err:
            async for chunk in c.stream(prompt_ids=[5, 6, 7], max_new_tokens=4):
                got.append(chunk)
        check_truncated(err.value)
        assert len(got) == (0 if ending == "silent" else 2)


@pytest.mark.parametrize("server", ["cut", "complete"], indirect=True)
async def test_leaving_the_stream_early_is_no_truncation(server: tuple[str, str]) -> None:
    """A caller that stops reading (the isolation probe does) cut the stream itself: no error."""
    target, _ = server
    async with AsyncClient(target, "key", timeout=10) as c:
        async for chunk in c.stream(prompt_ids=[5, 6, 7], max_new_tokens=4):
            assert chunk.token_ids == [104, 105]
            break


def make_app() -> typer.Typer:
    app = typer.Typer()
    groups = {"tenants": typer.Typer(), "model": typer.Typer()}
    for name, group in groups.items():
        app.add_typer(group, name=name)
    generate_cli.register(app, groups)
    return app


@pytest.mark.parametrize("as_json", [False, True])
async def test_cli_generate(server: tuple[str, str], as_json: bool) -> None:
    target, ending = server
    args = ["generate", "--target", target, "--api-key", "key", "--prompt-ids", "5,6,7", "-n", "4"]
    result = await asyncio.to_thread(
        CliRunner().invoke, make_app(), [*args, "--json"] if as_json else args
    )
    if ending == "complete":
        assert result.exit_code == 0, result.stderr
        if as_json:
            assert json.loads(result.stdout)["finish_reason"] == "length"
        else:
            assert result.stdout == "hi z\n"
    else:
        # Was exit 0 with the text cut short, or a JSON answer with finish_reason "".
        assert result.exit_code != 0
        assert result.stderr.startswith("UNAVAILABLE: the Generate stream ended without its")
        assert "finish_reason" not in result.stdout


def test_the_accumulator_gives_no_result_without_the_final_chunk() -> None:
    acc = GenerationAccumulator()
    acc.add(GenerationChunk("req-1", [104, 105], "hi"))
    with pytest.raises(Unavailable) as err:
        acc.result()  # was finish_reason "" and usage Usage(0, 2), made up
    check_truncated(err.value)
    acc.add(GenerationChunk("req-1", [], "!", "length", Usage(3, 2)))
    assert acc.result() == GenerationResult([104, 105], "hi!", "length", Usage(3, 2), "req-1")
