"""Checks on what nodes answer, before any of it reaches the client.

Decode verifies the KV itself (DESIGN.md "Transfer manifest"); these checks make sure the control
plane never relays an answer that is not about the request it asked for: a reservation of the wrong
size or of another node than the one called, a manifest of another request, tokens before
verification, a first token that does not continue prefill's, more tokens than asked for, tokens
after the one that ended the run (an EOS, a stop string), a stream that ends without a finish
reason or with another than its tokens call for.

A node's failed call reaches the client with its code and reason and a message of those alone
(``node_error``): the node's own text and its id go to the control plane's log, not to tenants.
"""

from __future__ import annotations

import grpc

from control_plane.admission import Prompt
from control_plane.detok import IncrementalDetokenizer
from control_plane.lifecycle import RequestRecord
from control_plane.registry import Node
from kvfence.detok import REPLACEMENT, GrowingText
from kvfence.errors import (
    NODE_DRAINING,
    NODE_RESTARTED,
    RESERVATION_RELEASED,
    IntegrityError,
    KvfenceError,
    Unavailable,
    from_rpc_error,
)
from kvfence.logging import get_logger
from kvfence.model.stops import find_stop, stream_safe_len
from kvfence.proto.kvfence.v1 import client_pb2, common_pb2, decode_pb2, prefill_pb2

log = get_logger("verify")


def check_reservation(
    node_id: str, res: prefill_pb2.Reservation, prompt: Prompt, pages: int
) -> None:
    if (
        res.prompt_tokens != len(prompt.token_ids)
        or res.max_new_tokens != prompt.sampling.max_new_tokens
        or len(res.pages) != pages
    ):
        # The node is the operator's to know (node ids are the cluster's topology), the numbers
        # are the request's own.
        log.warning(
            "reservation does not match the request",
            node_id=node_id,
            pages=len(res.pages),
            expected_pages=pages,
        )
        raise KvfenceError(
            f"the decode node returned a reservation of {len(res.pages)} pages for "
            f"{res.prompt_tokens}+{res.max_new_tokens} tokens; expected {pages} pages for "
            f"{len(prompt.token_ids)}+{prompt.sampling.max_new_tokens}",
            reason="RESERVATION_MISMATCH",
        )


def check_reservation_node(node: Node, res: prefill_pb2.Reservation) -> None:
    """The reservation must name the decode node the control plane called, and the UCX address
    that node registered: prefill sends the request's KV where it says. A decode node fills both
    from what it registered (its node id, its receiver's address), so they differ only when the
    answer is not the registered node's: a faulty or forged one, or a new process answering at
    the node's gRPC address in the moment before it registers (a restart in place; the request
    would fail NODE_LOST when the old registration goes). So not an integrity failure, whose
    alert is a security event: refused as a reservation of the wrong size is, the request
    failing and its Release reaching the node."""
    if res.decode_node_id == node.node_id and res.decode_ucx_address == node.ucx_address:
        return
    # Node ids and addresses are the cluster's topology: the operator's log, not the tenant's.
    log.warning(
        "reservation does not name the node that made it",
        node_id=node.node_id,
        reservation_node_id=res.decode_node_id,
        reservation_ucx_address=res.decode_ucx_address,
        registered_ucx_address=node.ucx_address,
    )
    raise KvfenceError(
        "the decode node returned a reservation for another node or transfer address than the "
        "one it registered",
        reason="RESERVATION_MISMATCH",
    )


def check_manifest(rec: RequestRecord, m: common_pb2.KvManifest, prompt_tokens: int) -> None:
    # Decode verifies the manifest fully; this catches a prefill answering for another request
    # before its manifest goes anywhere.
    if (
        m.request_id != rec.request_id
        or m.tenant_id != rec.tenant_id
        or m.reservation_id != rec.reservation_id
        or m.token_count != prompt_tokens
    ):
        raise IntegrityError(
            f"prefill returned a manifest that does not describe this request "
            f"(token_count {m.token_count}, expected {prompt_tokens})",
            reason="MANIFEST_MISMATCH",
        )


# What a client reads when a node's call failed: the code and reason (and the role) only, never the
# node's own text nor its id. A node's details name addresses and peers ("ipv4:10.0.0.3:50051:
# Connection refused", UCX's "cannot reach decode at 10.42.7.19:13337"), exceptions and other
# internals, and node ids are the cluster's topology: none of it is the tenant's. The whole of it
# goes to the control plane's log instead ("node call failed", node_error).
_TRANSFER_FAILED = "the KV transfer between this request's nodes failed"
_BY_REASON = {
    "NODE_UNREACHABLE": "the {role} node serving this request became unreachable",
    "NODE_CANCELLED": "the {role} node serving this request ended its call itself",
    # A prefill node's KV transfer to decode (prefill_svc.service.transfer_status): either node
    # may be the broken one.
    "TRANSFER_FAILED": _TRANSFER_FAILED,
    "UNREACHABLE": _TRANSFER_FAILED,
    "BATCH_TOO_LARGE": _TRANSFER_FAILED,
    "TIMEOUT": "the KV transfer between this request's nodes timed out",
    RESERVATION_RELEASED: "the decode node released this request's reservation before it was used",
    NODE_RESTARTED: "the decode node serving this request restarted and lost its reservation",
    NODE_DRAINING: "the {role} node serving this request is shutting down",
    # the registry lost the node (no heartbeat) with the request on it: control_plane.service
    "NODE_LOST": "the {role} node serving this request was lost",
}
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: "the {role} node refused this request",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the {role} node had no room for this request",
    grpc.StatusCode.UNAVAILABLE: "the {role} node serving this request is unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the {role} node did not finish this request in time",
    grpc.StatusCode.DATA_LOSS: "the {role} node reported a failed integrity check for this request",
    grpc.StatusCode.NOT_FOUND: "the {role} node serving this request does not know it",
    grpc.StatusCode.INTERNAL: "the {role} node serving this request failed",
}


def client_message(role: str, code: grpc.StatusCode, reason: str) -> str:
    """The message a client gets for a node's failed call: built from ``code`` and ``reason``
    (and the node's role) alone, whatever the node said (``_BY_REASON``)."""
    text = _BY_REASON.get(reason) or _BY_CODE.get(
        code, "the {role} node serving this request failed"
    )
    said = code.name if reason == code.name else f"{code.name}, {reason}"
    return f"{text.format(role=role)} ({said})"


def node_error(node: Node, err: grpc.aio.AioRpcError) -> KvfenceError:
    """A node's failed RPC as the client should see it: same code and reason, and a message of
    those alone (``client_message``). The node, its code and its own details are logged here
    ("node call failed", with the request's id and tenant bound by the caller's context), for
    operators."""
    base = from_rpc_error(err)
    if err.code() == grpc.StatusCode.UNAVAILABLE and base.reason == "UNAVAILABLE":
        base.reason = "NODE_UNREACHABLE"
    if err.code() == grpc.StatusCode.CANCELLED:
        # The node's, never the client's: a call the control plane cancels (client gone,
        # deadline, abort) ends as that interrupt before it gets here. As CANCELLED the client
        # took it for its own cancel (no retry) and the failure alerts ignored it.
        reason = "NODE_CANCELLED" if base.reason == "CANCELLED" else base.reason
        base = Unavailable(base.message, reason=reason, metadata=base.metadata)
    # A node shutting down on purpose (its drain timed out: a rolling update, a scale-down) is
    # no fault of the node's to warn about: the control plane marks it draining and counts
    # nothing against it (routing.node_failed). The request's own end is still logged.
    emit = log.info if base.reason == NODE_DRAINING else log.warning
    emit(
        "node call failed",
        node_id=node.node_id,
        role=node.role,
        code=err.code().name,  # the node's; the client's code and reason: "request ended"
        reason=base.reason,
        details=err.details(),
    )
    out = type(base)(
        client_message(node.role, base.code, base.reason),
        reason=base.reason,
        metadata=base.metadata,
    )
    out.code = base.code
    out.reported_by = node.node_id
    return out


class DecodeStream:
    """Checks the decode stream message by message and turns it into client responses.

    Text follows the colocated engine's rules (``kvfence.model.scheduler``): decode ends a
    sequence with "stop" once a stop string appears in its text, and the client's text ends
    before that stop string. So text that could still grow into a stop string is held back until
    the next message shows it does not, and text from a complete stop string on is never sent.
    Token ids are relayed as they come (the stop string's tokens and the EOS included, as the
    colocated engine returns them); the EOS that ends a run is not rendered as text.

    Decode ends a run at its first end, checked after each token in the colocated engine's order
    (``decode_svc.batcher``): an EOS that counts (not ``ignore_eos``) "eos", else a stop string in
    the text "stop", else max_new_tokens "length". It streams the tokens in messages of one or
    more, the finish reason last, and none after the token that ended the run. So a token after a
    counting EOS, or after the text already holds a stop string, is STREAM_ORDER, and the finish
    reason must be the one the tokens call for (FINISH_REASON): an answer run on past its end
    (text after the EOS, completion_tokens too high) is never relayed as complete. The stop string
    is looked for as decode looks for it: with an exact detokenizer (``kvfence.detok``: the byte,
    byte-level and SentencePiece byte-fallback tokenizers) the detokenizer's text, final or not
    yet, is the text decode searched after the same tokens. Another tokenizer's text here may
    differ from decode's: then only the tokens' own ends are checked (an EOS, the count), and
    "length" is taken with a stop string in the text as well as "stop".

    The text is kept as a :class:`~kvfence.detok.GrowingText` and read from its end: one string
    rebuilt per token cost the control plane time per token that grew with the answer.
    """

    def __init__(
        self,
        rec: RequestRecord,
        manifest: common_pb2.KvManifest,
        prompt: Prompt,
        detok: IncrementalDetokenizer,
        eos_ids: frozenset[int] = frozenset(),
    ):
        self.rec = rec
        self.first_token = manifest.first_token
        self.prompt = prompt
        self.detok = detok
        self.eos_ids = eos_ids
        self.verified = False
        self.finish_reason = ""
        self.completion_tokens = 0
        self.last_token: int | None = None
        self._final = GrowingText()  # every character the detokenizer has made final
        self.sent = 0  # of which this many went to the client
        self._stops = tuple(prompt.sampling.stop)
        self._counts_eos = not prompt.sampling.ignore_eos
        # A stop string found in the final text ended decode's run by then (class docstring).
        # getattr: a test's stand-in detokenizer may not say; it is then not taken as exact.
        self._stop_ends_run = bool(self._stops) and bool(getattr(detok, "exact", False))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._hold_reads = 2 * (self._longest + 4)  # characters _hold reads at least (or all)
        # The text only grows: the stop strings in it are looked for in what is new (plus the
        # longest stop string) and the first one found is kept.
        self._stop_at: int | None = None
        self._stop_searched = 0  # no stop string ends at or before this index of the text

    @property
    def text(self) -> str:
        """Every character the detokenizer has made final (a copy of the whole text)."""
        return str(self._final)

    def accept(self, msg: decode_pb2.DecodeResponse) -> client_pb2.GenerateResponse | None:
        if msg.verified:
            self.verified = True
        if self.finish_reason and (msg.token_ids or msg.finish_reason):
            raise IntegrityError("decode sent data after its last message", reason="STREAM_ORDER")
        if msg.token_ids and not self.verified:
            raise IntegrityError(
                "decode sent tokens before verifying the transferred KV", reason="UNVERIFIED"
            )
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
        if not msg.token_ids:
            return None
        ids = list(msg.token_ids)
        # The manifest's first_token was sampled by prefill; decode's stream repeats it as its
        # first token. A different one means decode is not continuing the KV prefill wrote.
        if self.completion_tokens == 0 and ids[0] != self.first_token:
            raise IntegrityError(
                f"decode's first token {ids[0]} differs from prefill's {self.first_token}",
                reason="FIRST_TOKEN_MISMATCH",
            )
        ended = self._run_ended()
        if ended or (self._counts_eos and not self.eos_ids.isdisjoint(ids[:-1])):
            raise IntegrityError(
                f"decode sent tokens after {ended or 'an EOS'} ended the run", reason="STREAM_ORDER"
            )
        self.completion_tokens += len(ids)
        self.last_token = ids[-1]
        limit = self.prompt.sampling.max_new_tokens
        if self.completion_tokens > limit:
            raise IntegrityError(
                f"decode sent {self.completion_tokens} tokens, more than max_new_tokens {limit}",
                reason="TOO_MANY_TOKENS",
            )
        # As the colocated engine renders text: the EOS that ends the run is never text (a
        # checkpoint may not mark it special, and its tokenizer would render "</s>"); an ignored
        # EOS is an ordinary token. Only the last id can be one that counts (above).
        text_ids = ids[:-1] if self._ends(ids[-1]) else ids
        if self._stop_ends_run and len(ids) > 1:
            # Decode ends the run at the token that completes a stop string, and batches tokens
            # into messages: the text of all but the last may hold none.
            self._final.append(self.detok.push(ids[:-1]))
            if self._stopped():
                raise IntegrityError(
                    "decode sent tokens after a stop string ended the run", reason="STREAM_ORDER"
                )
            text_ids = text_ids[len(ids) - 1 :]
        self._final.append(self.detok.push(text_ids))
        return client_pb2.GenerateResponse(
            request_id=self.rec.request_id, token_ids=ids, text=self._text(final=False)
        )

    def finish(self) -> client_pb2.GenerateResponse:
        if not self.verified or not self.finish_reason:
            raise Unavailable(
                "the decode stream ended before the request finished", reason="STREAM_TRUNCATED"
            )
        self._final.append(self.detok.flush())
        self._check_finish_reason()
        return client_pb2.GenerateResponse(
            request_id=self.rec.request_id,
            text=self._text(final=True),
            usage=common_pb2.Usage(
                prompt_tokens=len(self.prompt.token_ids), completion_tokens=self.completion_tokens
            ),
            finish_reason=self.finish_reason,
        )

    def _stop(self) -> int | None:
        """Where the first stop string begins in the text (find_stop of the whole text)."""
        if self._stop_at is None and self._stops:
            self._search(*self._final.suffix(max(0, self._stop_searched - self._longest)))
        return self._stop_at

    def _search(self, base: int, text: str) -> None:
        """Look for a stop string in what is new. ``text`` is the text from ``base`` on, and base
        is 0 or at most _stop_searched - _longest: a stop string that ends after _stop_searched
        begins after it, and with that one character more find_stop searches the suffix from
        the very place it would search the whole text."""
        at = find_stop(text, self._stops, self._stop_searched - base)
        self._stop_at = None if at is None else base + at
        self._stop_searched = base + len(text)

    def _hold(self, base: int, text: str) -> int:
        """stream_safe_len of the whole text, from its suffix ``text`` (from ``base`` on), which
        has at least 2 * need characters, or all of them. It reads the trailing U+FFFDs and the
        longest stop string before them (and at least its 4-character probe): after a long run
        of U+FFFD, more is read."""
        need = self._hold_reads // 2
        while base > 0 and text.endswith(REPLACEMENT) and len(text.rstrip(REPLACEMENT)) < need:
            base = max(0, base - len(text))  # twice as much: rare
            text = self._final.tail(base)
        return base + stream_safe_len(text, self._stops)

    def _text(self, final: bool) -> str:
        """The text the client may have now that it has not had yet."""
        if self._stop_at is not None and self.sent >= self._stop_at:
            return ""  # nothing from the stop string on is ever sent
        stops, size = self._stops, len(self._final)
        # One read of the text's end serves the stop search, the hold and what is sent, from the
        # first character one of them needs (usually no copy: GrowingText.suffix).
        first = self.sent
        if stops:
            first = min(first, size - self._hold_reads)
            if self._stop_at is None:
                first = min(first, self._stop_searched - self._longest)
        base, text = self._final.suffix(first if first > 0 else 0)  # base <= sent
        if stops and self._stop_at is None:
            self._search(base, text)
        if self._stop_at is not None:
            end = self._stop_at
        elif final or not stops:
            end = size
        else:
            end = self._hold(base, text)
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent - base : end - base], end
        return out

    def _ends(self, token: int) -> bool:
        """Whether ``token`` is an EOS that ends the run (not ignore_eos)."""
        return self._counts_eos and token in self.eos_ids

    def _run_ended(self) -> str:
        """What ended decode's run in the tokens accepted so far, as it would end it ("" while
        it runs on; max_new_tokens is TOO_MANY_TOKENS' to tell)."""
        if self.last_token is not None and self._ends(self.last_token):
            return "an EOS"
        # The last accept ended with _text, which searched the final text (_stop_at).
        if self._stop_ends_run and self._stopped(searched=True):
            return "a stop string"
        return ""

    def _stopped(self, searched: bool = False) -> bool:
        """Whether decode's text of the ids pushed so far holds a stop string (an exact
        detokenizer's only): the final text (``_stop``; ``searched``: it is up to date), or the
        text past it that is not final yet (a character still open), which decode's text has all
        the same (``IncrementalDetokenizer.text_from``: a window's worth)."""
        if (self._stop_at if searched else self._stop()) is not None:
            return True
        size = len(self._final)
        if not self.detok.text_from(size):
            return False
        # A stop string not in the final text ends past it.
        base = max(0, size - self._longest)
        return find_stop(self.detok.text_from(base), self._stops) is not None

    def _finishes(self) -> frozenset[str]:
        """The finish reasons the whole stream's tokens bear out: the first end of the run, in
        the colocated engine's order (class docstring)."""
        if self.completion_tokens == 0:
            return frozenset()  # decode always sends prefill's first token
        if self.last_token is not None and self._ends(self.last_token):
            return frozenset({"eos"})
        stop = bool(self._stops) and self._stop() is not None
        if stop and self._stop_ends_run:
            return frozenset({"stop"})
        length = self.completion_tokens == self.prompt.sampling.max_new_tokens
        return frozenset({"stop"} if stop else ()) | frozenset({"length"} if length else ())

    def _check_finish_reason(self) -> None:
        """A finish that the tokens do not bear out would end a request OK with wrong data (a
        truncated answer passed off as complete, or one run on past its end)."""
        sampling = self.prompt.sampling
        reason = self.finish_reason
        if reason not in self._finishes():
            raise IntegrityError(
                f"decode finished with {reason!r} after {self.completion_tokens} of "
                f"{sampling.max_new_tokens} tokens, which its tokens do not bear out",
                reason="FINISH_REASON",
            )
