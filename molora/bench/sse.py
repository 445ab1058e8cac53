"""Reading an OpenAI-style server-sent event stream (`data: {...}` lines ending in `data: [DONE]`): the one SSE
client the serving benchmark and the fault harness share.

    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        stream = SSEStream(r)
        async for event in stream:       # each `data:` line's JSON, in order; comments (`: keep-alive`) skipped
            ...
        stream.done                      # True when the server sent `data: [DONE]`
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


class SSEStream:
    """The JSON events of one streamed response (an httpx response being streamed)."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self.done = False  # the stream ended with `data: [DONE]`

    async def __aiter__(self) -> AsyncIterator[dict]:
        async for line in self.response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                self.done = True
                return
            yield json.loads(line[6:])
