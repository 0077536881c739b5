"""uvicorn's h11 protocol with two changes: a deadline for the request head, and its 400 for a
request h11 cannot parse (a bad chunk size, a head over --max-header) as an OpenAI error object.

uvicorn times out only idle keep-alive connections; a client that sends half a head holds its
connection (and a place under uvicorn's concurrency limit) forever. Here a connection must
deliver each request head within the read timeout of opening or of its previous response,
else it is closed. The body's deadline is the Guard's (security.py), which can answer 408.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import APIError


def protocol_class(read_timeout: float) -> type[asyncio.Protocol]:
    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._arm()

        def _arm(self) -> None:
            """Wait read_timeout for the head of the request after self.cycle's."""
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_of = self.cycle
            self._head_timer = self.loop.call_later(read_timeout, self._head_expired)

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_of and not self.transport.is_closing():
                self.transport.close()  # no request to answer: h11 allows no response here

        def handle_events(self) -> None:
            super().handle_events()
            if self._head_timer is not None and self.cycle is not self._head_of:
                self._head_timer.cancel()  # a head arrived: the body's deadline is the Guard's
                self._head_timer = None

        def on_response_complete(self) -> None:
            self._arm()  # before super(), which may start a pipelined request's cycle
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            resp = APIError(400, "the request is not valid HTTP/1.1 (its head, chunk framing or "
                                 "body length)", headers={"Connection": "close"}).response()
            try:
                headers = self.server_state.default_headers + resp.raw_headers  # date, server
                for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                              h11.Data(data=resp.body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # a response was already under way: just close
                pass
            self.transport.close()

    return Protocol
