"""An admin token gRPC cannot put in a header (a CRLF token file's ``\\r``, a non-ASCII letter) is
one line saying why, not gRPC's "INTERNAL: Invalid metadata" and its C-core log
(kvfence.auth.unsendable)."""

from __future__ import annotations

import pytest
from test_cli_robustness import assert_one_line_error, free_port, invoke

from kvfence.auth import unsendable


@pytest.mark.parametrize("token", ["kvfa_x\r", "kvfa_ключ"])
def test_an_admin_token_grpc_cannot_send_is_one_line(token: str) -> None:
    # Control: a printable token is sent, and the call fails at the (absent) control plane.
    target = f"127.0.0.1:{free_port()}"
    result = invoke("nodes", "--target", target, "--admin-token", token)
    assert_one_line_error(result, 1, "the admin token cannot be sent: it holds")
    assert "Invalid metadata" not in result.output
    result = invoke("nodes", "--target", target, "--admin-token", "kvfa_x")
    assert_one_line_error(result, 1, "cannot reach the admin API")


def test_unsendable_accepts_printable_ascii_only() -> None:
    assert unsendable("".join(chr(c) for c in range(0x20, 0x7F))) is None
    for c in ("\t", "\r", "\n", "\x00", "\x7f", "é"):
        assert unsendable(f"k{c}") is not None, repr(c)
