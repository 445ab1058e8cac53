"""A header deadline for uvicorn's HTTP protocols: a connection that has not sent a request's complete headers within
`HEADER_TIMEOUT_S` of connecting (or of starting a new request on a kept-alive connection) is closed.

uvicorn times out idle kept-alive connections, but not one that trickles its headers a byte at a time or connects
and sends nothing (one such connection held for 47 s was measured against the plain server): each one holds a
socket and, while its request line is unread, some parser state. The body has its own floor
(molora.server.guards.parse_body). `protocol_class()` gives the subclass of uvicorn's protocol (httptools when
installed, else h11) that `uvicorn.Config(http=...)` takes.

Knows uvicorn's protocol objects (their `cycle`: the request being answered); nothing of the app.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["HEADER_TIMEOUT_S", "protocol_class"]

HEADER_TIMEOUT_S = 10.0


def protocol_class(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (httptools, else h11) with the header deadline."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is an optional extra of uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]

    class HeaderDeadline(base):  # type: ignore[valid-type, misc]
        _deadline: asyncio.TimerHandle | None = None
        _seen: Any = None  # the cycle when the deadline was armed: a new one means the headers arrived

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self._seen:  # a request's headers were parsed
                self._disarm()
                self._seen = self.cycle
            elif self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._seen = self.cycle
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            waiting = self.cycle is self._seen and (self.cycle is None or self.cycle.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

    HeaderDeadline.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline
