"""What a tenant reads when a node fails its request: the code, the reason and a message of those.

A node's failed call reached the client as "{role} node {node_id}: {the node's details}", word
for word: gRPC's "ipv4:127.0.0.1:40113: Failed to connect to remote host", prefill's "cannot
reach decode at 10.42.7.19:13337: UCXConnectionResetError(...)". Addresses, exception text and
node ids are the cluster's, not the tenant's. Now the client's message is built from the code and
the reason alone (``control_plane.verify.client_message``), code and ErrorInfo reason unchanged;
the node, its address and its details go to the control plane's log ("node call failed"), with
the request's id and tenant, which is each test's control: nothing is lost to operators.
"""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from cp_harness import Cluster, make_cluster
from structlog.testing import capture_logs

from control_plane.admission import Prompt
from control_plane.routing import NodeClients
from control_plane.verify import check_reservation, client_message
from kvfence.errors import IntegrityError, InvalidArgument, KvfenceError, Unavailable
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2
from kvfence.transfer import TransferError
from prefill_svc.service import transfer_status

UCX_DETAILS = "cannot reach decode at 10.42.7.19:13337: UCXConnectionResetError('Endpoint timeout')"


def with_context() -> Any:
    """capture_logs with the request's bound fields (request_id, tenant_id) merged in."""
    return capture_logs(processors=[structlog.contextvars.merge_contextvars])


def node_failures(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "node call failed"]


def assert_nothing_of_the_node(message: str, *fragments: str) -> None:
    for fragment in ("decode-0", "prefill-0", "127.0.0.1", *fragments):
        assert fragment not in message, (fragment, message)


async def test_a_transfer_failure_naming_an_address_reaches_the_client_without_it(
    cluster: Cluster,
) -> None:
    """Prefill's transfer_status of a UCX failure (what a real prefill node answers). The client
    keeps UNAVAILABLE / UNREACHABLE; the cool-down still counts it against both nodes (routing
    keys on the reason). Control: the control plane's log line has the node and its details."""
    cluster.script.prefill_error = transfer_status(TransferError(UCX_DETAILS, "UNREACHABLE"))
    with with_context() as logs, pytest.raises(Unavailable) as err:
        await cluster.client().generate(prompt_ids=[5, 6, 7], max_new_tokens=4)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "UNREACHABLE")
    assert err.value.message == (
        "the KV transfer between this request's nodes failed (UNAVAILABLE, UNREACHABLE)"
    )
    assert_nothing_of_the_node(
        err.value.message, "10.42.7.19", "13337", "UCX", "cannot reach", "prefill node"
    )
    # routing's node_failed still sees the reason: a failed transfer counts against both nodes
    assert [n.failures for n in cluster.cp.registry.nodes()] == [1, 1]
    [failed] = cluster.events.of("request_failed")
    [line] = node_failures(logs)
    assert line["log_level"] == "warning"
    assert (line["node_id"], line["role"], line["reason"]) == (
        "prefill-0",
        "prefill",
        "UNREACHABLE",
    )
    assert line["code"] == "UNAVAILABLE"
    assert UCX_DETAILS in line["details"]
    assert (line["request_id"], line["tenant_id"]) == (failed["request_id"], "acme")


async def test_an_unreachable_decode_node_is_named_by_its_role_only(tmp_path: Path) -> None:
    """The decode process dies between Reserve and Decode: gRPC's details name its address and
    port. The client gets NODE_UNREACHABLE and "the decode node". Control: the log line has the
    address in the node's details."""
    c = await make_cluster(tmp_path)
    try:
        c.script.prefill_hold = asyncio.Event()
        decode = c.decode[0]
        address = c.cp.registry.get("decode-0").grpc_address
        with with_context() as logs:
            task = asyncio.create_task(c.client().generate(prompt_ids=[5, 6, 7], max_new_tokens=4))
            await c.prefill[0].servicer.entered.wait()  # Reserve answered, prefill running
            assert decode.server is not None
            await decode.server.stop(0)  # heartbeats go on: the node is not lost yet
            c.script.prefill_hold.set()
            with pytest.raises(Unavailable) as err:
                await asyncio.wait_for(task, 5)
        assert err.value.reason == "NODE_UNREACHABLE"
        assert err.value.message == (
            "the decode node serving this request became unreachable "
            "(UNAVAILABLE, NODE_UNREACHABLE)"
        )
        assert_nothing_of_the_node(err.value.message, address, address.rsplit(":", 1)[1])
        [line] = node_failures(logs)
        assert (line["node_id"], line["role"]) == ("decode-0", "decode")
        assert address in line["details"] and line["tenant_id"] == "acme"
    finally:
        c.script.prefill_hold.set()
        await c.close()


@pytest.mark.parametrize(
    ("role", "error"),
    [
        ("decode", IntegrityError("checksum of page 3 at 10.0.0.9", reason="CHECKSUM_MISMATCH")),
        ("decode", KvfenceError("engine at /opt/kvfence/decode-0 crashed")),
        ("prefill", InvalidArgument("pool of prefill-0 at 10.0.0.9 refuses it", reason="NO")),
    ],
)
async def test_every_code_keeps_its_code_and_reason_and_drops_the_nodes_text(
    cluster: Cluster, role: str, error: KvfenceError
) -> None:
    """Any code, not only UNAVAILABLE: the message is the code's and the reason's. Control: the
    log line has the node's own text."""
    setattr(cluster.script, f"{role}_error", error)
    with with_context() as logs, pytest.raises(KvfenceError) as err:
        await cluster.client().generate(prompt_ids=[5, 6, 7], max_new_tokens=4)
    assert (err.value.code, err.value.reason) == (error.code, error.reason)
    assert err.value.message == client_message(role, error.code, error.reason)
    assert error.message not in err.value.message
    assert_nothing_of_the_node(err.value.message, "10.0.0.9", "/opt", "page 3")
    [line] = node_failures(logs)
    assert (line["node_id"], line["role"]) == (f"{role}-0", role)
    assert error.message in line["details"]


def test_client_messages_depend_on_code_and_reason_only() -> None:
    """The fallbacks: a reason of its own, else the code's message, else a generic one."""
    assert client_message("prefill", grpc.StatusCode.DEADLINE_EXCEEDED, "TIMEOUT") == (
        "the KV transfer between this request's nodes timed out (DEADLINE_EXCEEDED, TIMEOUT)"
    )
    assert client_message("decode", grpc.StatusCode.INTERNAL, "INTERNAL") == (
        "the decode node serving this request failed (INTERNAL)"
    )
    assert client_message("decode", grpc.StatusCode.UNKNOWN, "INTERNAL") == (
        "the decode node serving this request failed (UNKNOWN, INTERNAL)"
    )


async def test_a_decode_node_lost_after_answering_reserve_is_not_named(tmp_path: Path) -> None:
    """The Reserve's answer came, then the node was lost: NODE_LOST without the node's id.
    Control: the control plane's log names it."""
    c = await make_cluster(tmp_path)
    try:
        real = c.cp.clients.decode

        def decode(node: Any) -> Any:  # the reaper runs between the answer and the request
            stub = real(node)

            class LostOnAnswer:
                def __getattr__(self, name: str) -> Any:
                    return getattr(stub, name)

                async def Reserve(self, req: Any, timeout: float | None = None) -> Any:
                    res = await stub.Reserve(req, timeout=timeout)
                    c.cp.registry.lose(node, "no heartbeat")
                    return res

            return LostOnAnswer()

        c.cp.clients.decode = decode  # type: ignore[method-assign]
        with capture_logs() as logs, pytest.raises(Unavailable) as err:
            await c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        assert err.value.reason == "NODE_LOST"
        assert err.value.message == "the decode node serving this request was lost"
        [line] = [e for e in logs if e["event"] == "decode node lost after answering reserve"]
        assert line["node_id"] == "decode-0" and line["log_level"] == "warning"
    finally:
        await c.close()


async def test_an_old_view_of_a_node_is_refused_without_its_id() -> None:
    """NodeClients refuses a node no longer registered as chosen: NODE_LOST, no id. Control: the
    log line names it, and a registered node gets its stub."""
    lost = {"decode-7"}
    clients = NodeClients("kvfn_token", registered=lambda n: n.node_id not in lost)

    def node(node_id: str) -> Any:
        return types.SimpleNamespace(node_id=node_id, role="decode", grpc_address="10.0.0.9:1")

    try:
        with capture_logs() as logs, pytest.raises(Unavailable) as err:
            clients.decode(node("decode-7"))
        assert err.value.reason == "NODE_LOST"
        assert "decode-7" not in err.value.message and "10.0.0.9" not in err.value.message
        assert err.value.message.startswith("the decode node chosen for this request was lost")
        [line] = logs
        assert line["node_id"] == "decode-7"
        assert clients.decode(node("decode-1")) is not None  # control: registered
    finally:
        await clients.close()


def test_a_reservation_mismatch_names_the_numbers_not_the_node() -> None:
    """The request's own numbers stay in the message; the node's id goes to the log."""
    prompt = Prompt([1, 2], common_pb2.SamplingParams(max_new_tokens=2))
    res = prefill_pb2.Reservation(
        prompt_tokens=2, max_new_tokens=2, pages=[common_pb2.PageRef(page_id=0, generation=1)]
    )
    with capture_logs() as logs, pytest.raises(KvfenceError) as err:
        check_reservation("decode-3", res, prompt, 2)
    assert err.value.reason == "RESERVATION_MISMATCH"
    assert err.value.message == (
        "the decode node returned a reservation of 1 pages for 2+2 tokens; expected 2 pages for 2+2"
    )
    [line] = logs
    assert line["node_id"] == "decode-3"
    check_reservation("decode-3", res, prompt, 1)  # control: a matching one passes
