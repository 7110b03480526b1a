"""Which ledger and limiter a gateway uses, from the server config: SQLite and this process's
memory (the embedded default, one process), or PostgreSQL and Redis that every replica of a
deployment shares, so that spend caps and rate limits hold across all of them."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from gateway.config import ServerConfig
from gateway.tenants import Tenant
from gateway.usage.ledger import Ledger
from gateway.usage.limits import RateLimiter, SpendGuard

SQLITE = "sqlite:///"


class Rates(Protocol):
    """Requests and tokens a minute per tenant; a refusal raises a 429 GatewayError."""

    def take_request(self, tenant: Tenant) -> None: ...

    def take_tokens(self, tenant: Tenant, n: int) -> None: ...

    def tokens_empty(self, tenant: Tenant) -> float: ...

    def settle_tokens(self, tenant: Tenant, reserved: int, used: int) -> None: ...


class Spend(Protocol):
    """The monthly spend cap; a refusal raises a 402 GatewayError."""

    def check_open(self, tenant: Tenant) -> None: ...

    def reserve(self, tenant: Tenant, estimate: float) -> None: ...

    def release(self, tenant: Tenant, estimate: float) -> None: ...


def ledger_location(url: str, data_dir: Path) -> str | Path:
    """A sqlite:/// URL as a file (relative ones under the data folder); other URLs as they are."""
    if url.startswith(SQLITE):
        path = Path(url[len(SQLITE):])
        return path if path.is_absolute() else data_dir / path
    return url


def open_storage(config: ServerConfig, data_dir: Path) -> tuple[Ledger, Rates, Spend]:
    ledger = Ledger(ledger_location(config.ledger, data_dir), config.ledger_synchronous)
    if config.limits == "memory":
        return ledger, RateLimiter(), SpendGuard(ledger)
    from gateway.usage.limits_redis import RedisRateLimiter, RedisSpendGuard, connect
    client = connect(config.limits)
    return ledger, RedisRateLimiter(client), RedisSpendGuard(ledger, client)
