"""What keeps one tenant, or all of them, from taking more than their share: rate limits
(token buckets), the monthly spend cap, and the bounded queue in front of the engine.

All state here is touched only from the event loop, between awaits, so a check and the
reservation that follows it are one atomic step without locks.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from datetime import datetime, timezone

from gateway.errors import GatewayError, retry_after
from gateway.tenants import Tenant
from gateway.usage.ledger import Ledger


class TokenBucket:
    """Holds up to `per_minute` tokens and refills at `per_minute` a minute. A take larger
    than the whole bucket needs a full bucket and leaves it in debt, so a tenant whose one
    request exceeds its per-minute limit is slowed down rather than refused forever."""

    def __init__(self, per_minute: int):
        self.capacity = float(per_minute)
        self.level = self.capacity
        self.stamp = time.monotonic()

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def resize(self, per_minute: int) -> None:
        """Follow a tenant file edit without resetting what was spent."""
        if per_minute != self.capacity:
            self._refill(time.monotonic())
            self.capacity = float(per_minute)
            self.level = min(self.level, self.capacity)

    def take(self, n: float) -> float:
        """Take n tokens and return 0, or take nothing and return the seconds until they fit."""
        now = time.monotonic()
        self._refill(now)
        need = min(n, self.capacity)
        if self.level >= need:
            self.level -= n
            return 0.0
        return (need - self.level) * 60.0 / self.capacity

    def available(self) -> float:
        self._refill(time.monotonic())
        return self.level

    def give_back(self, n: float) -> None:
        self._refill(time.monotonic())
        self.level = min(self.capacity, self.level + n)


class RateLimiter:
    """Per tenant: requests a minute and tokens (prompt plus output) a minute."""

    def __init__(self):
        self.requests: dict[str, TokenBucket] = {}
        self.tokens: dict[str, TokenBucket] = {}

    def _bucket(self, table: dict[str, TokenBucket], tenant_id: str, per_minute: int) -> TokenBucket:
        bucket = table.get(tenant_id)
        if bucket is None:
            bucket = table[tenant_id] = TokenBucket(per_minute)
        bucket.resize(per_minute)
        return bucket

    def take_request(self, tenant: Tenant) -> None:
        rpm = tenant.spec.limits.requests_per_minute
        wait = self._bucket(self.requests, tenant.id, rpm).take(1)
        if wait:
            raise retry_after(429, f"tenant {tenant.id!r} is over its limit of {rpm} requests per minute; "
                                   f"retry in {wait:.1f} s", wait, "rate_limit_requests")

    def take_tokens(self, tenant: Tenant, n: int) -> None:
        """Reserve the worst case (prompt + max output tokens); `settle_tokens` returns the rest."""
        tpm = tenant.spec.limits.tokens_per_minute
        wait = self._bucket(self.tokens, tenant.id, tpm).take(n)
        if wait:
            raise retry_after(429, f"tenant {tenant.id!r} is over its limit of {tpm} tokens per minute "
                                   f"(this request may use up to {n}); retry in {wait:.1f} s",
                              wait, "rate_limit_tokens")

    def tokens_empty(self, tenant: Tenant) -> float:
        """Seconds until the token bucket has any tokens: a cheap refusal before retrieval."""
        bucket = self._bucket(self.tokens, tenant.id, tenant.spec.limits.tokens_per_minute)
        level = bucket.available()
        return 0.0 if level > 0 else (1 - level) * 60.0 / bucket.capacity

    def settle_tokens(self, tenant: Tenant, reserved: int, used: int) -> None:
        if reserved > used:
            self._bucket(self.tokens, tenant.id, tenant.spec.limits.tokens_per_minute).give_back(reserved - used)


def dollars(amount: float) -> str:
    """Money for a message: cents, or three significant digits where cents would hide them
    ($0.20, $12.35, $0.005, $0.000123), so a cap under a cent does not read $0.00."""
    extra = 0 if amount <= 0 else max(0, -math.floor(math.log10(amount)))    # decimals past the cents
    text = f"{amount:.{2 + extra}f}"
    return "$" + (text[:len(text) - extra] + text[len(text) - extra:].rstrip("0") if extra else text)


def month_of(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m")


class SpendGuard:
    """The monthly spend cap. A request may start only if what the ledger says was spent
    this month, plus the worst case of every request still running, plus its own worst
    case stays under the cap; so the cap holds even under concurrency. The real cost is
    settled into the ledger when the request ends."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.reserved: dict[str, float] = defaultdict(float)

    def _left(self, tenant: Tenant) -> tuple[float, float]:
        cap = tenant.spec.limits.monthly_spend_cap_usd
        spent = self.ledger.spent(tenant.id, month_of(time.time()))
        return cap, cap - spent - self.reserved[tenant.id]

    def check_open(self, tenant: Tenant) -> None:
        cap, left = self._left(tenant)
        if left <= 0:
            raise GatewayError(402, f"tenant {tenant.id!r} has spent its monthly cap of {dollars(cap)}",
                               code="spend_cap_reached")

    def _take(self, tenant: Tenant, estimate: float) -> tuple[float, float]:
        """Reserve `estimate` if it fits in what is left, as one atomic step; (cap, left before)."""
        cap, left = self._left(tenant)
        if estimate <= left:
            self.reserved[tenant.id] += estimate
        return cap, left

    def reserve(self, tenant: Tenant, estimate: float) -> None:
        cap, left = self._take(tenant, estimate)
        if estimate > left:
            raise GatewayError(402, f"this request may cost up to {dollars(estimate)} but tenant {tenant.id!r} "
                                    f"has {dollars(max(left, 0))} left of its monthly cap of {dollars(cap)}; ask for "
                                    f"fewer output tokens or raise the cap", code="spend_cap_reached")

    def release(self, tenant: Tenant, estimate: float) -> None:
        self.reserved[tenant.id] = max(0.0, self.reserved[tenant.id] - estimate)


class Admission:
    """The bounded queue in front of the engine: `slots` generations at once, `queue` more
    waiting in arrival order, and a 503 with Retry-After for anything past that, or for a
    request that the queue's pace says would not start before its deadline (the mean time a
    slot is held, as recent requests held it, times the rounds of slots ahead of it)."""

    def __init__(self, slots: int, queue: int, retry_after_s: float = 1.0):
        self.slots, self.queue, self.retry_after_s = slots, queue, retry_after_s
        self.running = 0
        self.waiting = 0
        self.held_s = 0.0                # moving mean of how long a request holds its slot
        self._free = asyncio.Semaphore(slots)

    def expected_wait(self) -> float:
        """Seconds a request arriving now would wait for a slot, at the recent pace."""
        return 0.0 if not self._free.locked() else math.ceil((self.waiting + 1) / self.slots) * self.held_s

    @asynccontextmanager
    async def slot(self, deadline: float | None = None):
        """Yields the seconds spent waiting for a slot. `deadline` (time.monotonic()): refuse
        now what could not start before it, and give up waiting at it (504)."""
        if self._free.locked() and self.waiting >= self.queue:
            raise retry_after(503, f"the server is at capacity ({self.running} generating, {self.waiting} "
                                   f"queued); retry shortly", self.retry_after_s, "overloaded")
        start = time.monotonic()
        wait = self.expected_wait()
        if deadline is not None and start + wait >= deadline:
            raise retry_after(503, f"the server is too busy to start this request before its deadline (about "
                                   f"{wait:.0f} s of queue ahead of it); retry later", max(wait, self.retry_after_s),
                              "overloaded")
        self.waiting += 1
        try:
            await asyncio.wait_for(self._free.acquire(), None if deadline is None else deadline - start)
        except TimeoutError:
            raise GatewayError(504, f"the request waited {time.monotonic() - start:.1f} s for an engine slot and "
                                    f"passed its deadline; nothing was generated", code="deadline_exceeded") from None
        finally:
            self.waiting -= 1
        self.running += 1
        got = time.monotonic()
        try:
            yield got - start
        finally:
            self.running -= 1
            self._free.release()
            self.held_s += 0.2 * ((time.monotonic() - got) - self.held_s)
