"""Who a request belongs to (its tenant), and the optional limits per tenant.

A request's tenant, in this order: the name of the API key it came with (`--api-key NAME=KEY`; a plain `--api-key
KEY` has no name), else the OpenAI `user` field of its body, else the adapter its model name pins (`base:adapter`
or an adapter's own id), else "default". The tenant is the unit of the engine's fair share
(`--scheduling-policy fair`, molora.engine.policy) and of the per-tenant metrics. A `user` field is what the
client says it is: where tenants must not be able to pose as each other, give each one a named key (a named key's
name wins over `user`).

Limits (all off by default), checked when a request arrives, before anything is queued; a refusal answers 429
with Retry-After and a message naming the tenant and its limit:
  max_queued          engine requests a tenant may have in flight (queued or running) at once (each choice of
                      `n` and each prompt of a batch counts);
  tokens_per_minute   prompt and completion tokens a tenant may use in any 60 s: a request's prompt tokens count
                      when it arrives, its completion tokens when it ends; a request is refused while the last
                      60 s already hold the limit, and Retry-After says when enough of them leave the window.

Knows key names, request fields and a clock; nothing of engines, routes or FastAPI.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from molora.errors import MoLoRAError

TENANT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@\-]{0,63}")  # a key's name: what metrics and logs show
WINDOW_S = 60.0
DEFAULT_TENANT = "default"


def parse_api_keys(values: Sequence[str]) -> dict[str, str | None]:
    """{key: its tenant name or None} from `--api-key` values: `NAME=KEY` names a key (NAME as TENANT_NAME), any
    other value is a key without a name (a key ending in base64 padding, `abc==`, too). A key that holds "=" after a
    NAME-like prefix elsewhere must be given named."""
    out: dict[str, str | None] = {}
    for value in values:
        name, sep, key = value.partition("=")
        if sep and not key.strip("="):
            out[value] = None  # only padding after the "=": an unnamed key
        elif sep and TENANT_NAME.fullmatch(name):
            out[key] = name
        else:
            out[value] = None
    return out


def tenant_of(key_name: str | None, user: str | None, adapter: str | None) -> str:
    """A request's tenant (module docstring)."""
    return key_name or user or adapter or DEFAULT_TENANT


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits (module docstring); None: no limit."""

    max_queued: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for flag, value in (
            ("--tenant-max-queued", self.max_queued),
            ("--tenant-tokens-per-minute", self.tokens_per_minute),
        ):
            if value is not None and value < 1:
                raise MoLoRAError(f"{flag} {value}: give a positive number (or leave it out: no limit)")


class TenantLimitExceeded(Exception):
    """A tenant is over one of its limits: 429 with this message and Retry-After `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int, limit: str) -> None:
        super().__init__(message)
        self.retry_after_s, self.limit = retry_after_s, limit  # limit: "queued" or "tokens_per_minute"


class Tenants:
    """The in-flight counts and token windows behind TenantLimits. `clock`: seconds, monotonic (tests pass their
    own). All calls come from the server's event loop."""

    def __init__(self, limits: TenantLimits = TenantLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self.in_flight: dict[str, int] = {}
        self._used: dict[str, deque[tuple[float, int]]] = {}  # tenant -> (when, tokens) within the window

    def admit(self, tenant: str, requests: int, prompt_tokens: int, retry_after_s: int) -> None:
        """Take `requests` engine requests of `tenant` with `prompt_tokens` in all, or raise TenantLimitExceeded
        (nothing taken). `retry_after_s`: what a refusal by the in-flight limit advises (the server's default)."""
        lim = self.limits
        held = self.in_flight.get(tenant, 0)
        if lim.max_queued is not None and held + requests > lim.max_queued:
            raise TenantLimitExceeded(
                f"tenant {tenant!r} has {held} requests in flight and this one adds {requests}; its limit is "
                f"{lim.max_queued} (--tenant-max-queued); retry after {retry_after_s} s",
                retry_after_s,
                "queued",
            )
        if lim.tokens_per_minute is not None:
            used = self._window(tenant)
            if used >= lim.tokens_per_minute:
                wait = self._until_below(tenant, lim.tokens_per_minute)
                raise TenantLimitExceeded(
                    f"tenant {tenant!r} used {used} tokens in the last {WINDOW_S:g} s; its limit is "
                    f"{lim.tokens_per_minute} tokens per minute (--tenant-tokens-per-minute); retry after {wait} s",
                    wait,
                    "tokens_per_minute",
                )
        self.in_flight[tenant] = held + requests
        self.use(tenant, prompt_tokens)

    def use(self, tenant: str, tokens: int) -> None:
        """Count `tokens` against the tenant's window now (only while a tokens-per-minute limit is set)."""
        if self.limits.tokens_per_minute is not None and tokens > 0:
            self._used.setdefault(tenant, deque()).append((self.clock(), tokens))

    def done(self, tenant: str, requests: int, completion_tokens: int) -> None:
        """`requests` of the tenant's engine requests ended, having generated `completion_tokens`."""
        left = self.in_flight.get(tenant, 0) - requests
        assert left >= 0, f"tenant {tenant!r} released more requests than it held"
        if left:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)
        self.use(tenant, completion_tokens)

    def _window(self, tenant: str) -> int:
        q = self._used.get(tenant)
        if q is None:
            return 0
        start = self.clock() - WINDOW_S
        while q and q[0][0] <= start:
            q.popleft()
        if not q:
            del self._used[tenant]
            return 0
        return sum(n for _, n in q)

    def _until_below(self, tenant: str, limit: int) -> int:
        """Whole seconds until the tenant's window holds fewer than `limit` tokens (at least 1)."""
        q, total = self._used[tenant], self._window(tenant)
        for when, n in q:
            total -= n
            if total < limit:
                return max(1, math.ceil(when + WINDOW_S - self.clock()))
        return max(1, math.ceil(WINDOW_S))
