"""Rate limits and the monthly spend cap in Redis, shared by every replica of a deployment.
Each check-and-take is one Lua script, so two replicas can never both admit the request
that passes a limit. (Standalone Redis: the spend script reads holder keys it names itself,
which Redis Cluster would refuse.)

Rate limits: limits.TokenBucket's bucket, its state in a Redis hash and timed by Redis's
clock, so replicas whose clocks differ still agree.

Spend: Redis holds the reservations of requests in flight, per holder (one gateway), and a
mirror of the ledger's monthly total. The ledger's writer adds each committed batch to the
mirror before any request of that batch returns and releases its reservation, so the mirror
plus the reservations never count less than the ledger will hold. The mirror is seeded
from the ledger when it is missing (first use, expiry, a Redis restart); a commit that
finds it missing bumps the month's epoch instead, and a seed is written only if the epoch it
read before reading the ledger is unchanged, so no commit slips between the two. The mirror
expires every few minutes and is seeded again, bounding any drift (rows a gateway without
these limits wrote). A holder refreshes its heartbeat key from a thread; when a process dies
its reservations are dropped once the heartbeat lapses.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
import weakref
from collections import defaultdict

import redis

from gateway.errors import GatewayError, retry_after
from gateway.tenants import Tenant
from gateway.usage.ledger import Ledger
from gateway.usage.limits import RateLimiter, SpendGuard, month_of
from gateway.usage.rows import UsageRow

log = logging.getLogger("sluice.limits")
PREFIX = "sluice:"
MIRROR_TTL_MS = 300_000
EPOCH_TTL_S = 40 * 86_400            # a month and a bit: old months' epochs clean themselves up

# KEYS[1]: the bucket; ARGV: per minute, take | peek | give, n. Returns {seconds to wait, level}.
BUCKET = """
local cap, op, n = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local s = redis.call('HMGET', KEYS[1], 'level', 'stamp', 'cap')
local level, stamp, old = tonumber(s[1]), tonumber(s[2]), tonumber(s[3])
if not level then level, stamp, old = cap, now, cap end
level = math.min(math.min(old, level + (now - stamp) * old / 60), cap)
local wait = 0
if op == 'take' then
  local need = math.min(n, cap)
  if level >= need then level = level - n else wait = (need - level) * 60 / cap end
elseif op == 'give' then
  level = math.min(cap, level + n)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'stamp', tostring(now), 'cap', tostring(cap))
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - level) * 60000 / cap) + 1000)
return {tostring(wait), tostring(level)}
"""

# KEYS: the spend mirror, the tenant's reservations (holder -> dollars). ARGV: cap, estimate
# ('' only looks), holder, heartbeat ms. Returns {'seed'} or {'ok', left before this request}.
SPEND = """
local spent = redis.call('GET', KEYS[1])
if not spent then return {'seed'} end
local reserved = 0
local held = redis.call('HGETALL', KEYS[2])
for i = 1, #held, 2 do
  if held[i] == ARGV[3] or redis.call('EXISTS', '""" + PREFIX + """holder:' .. held[i]) == 1 then
    reserved = reserved + tonumber(held[i + 1])
  else
    redis.call('HDEL', KEYS[2], held[i])
  end
end
local left = tonumber(ARGV[1]) - tonumber(spent) - reserved
if ARGV[2] ~= '' and tonumber(ARGV[2]) <= left then
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[3], ARGV[2])
  redis.call('SET', '""" + PREFIX + """holder:' .. ARGV[3], '1', 'PX', ARGV[4])
end
return {'ok', tostring(left)}
"""

# KEYS[1]: the tenant's reservations; ARGV: holder, dollars.
RELEASE = """
local v = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], ARGV[1], -tonumber(ARGV[2])))
if v <= 1e-9 then redis.call('HDEL', KEYS[1], ARGV[1]) end
"""

# KEYS: the spend mirror, the month's epoch; ARGV: dollars committed.
MIRROR = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
else
  redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], """ + str(EPOCH_TTL_S) + """)
end
"""

# KEYS: the spend mirror, the month's epoch; ARGV: the ledger's total, the epoch read before it, ttl ms.
SEED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 1 end
if (redis.call('GET', KEYS[2]) or '0') ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""


def connect(url: str) -> redis.Redis:
    # Short timeouts: these calls run on the event loop, and a lost Redis must become a 503, not a hang.
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def unavailable(e: redis.RedisError) -> GatewayError:
    return retry_after(503, f"the shared limits store (Redis) cannot be reached: {e}", 1, "limits_unavailable")


class RedisBucket:
    """limits.TokenBucket's interface over one Redis key; `capacity` is the tenant's current limit."""

    def __init__(self, script, key: str, per_minute: int):
        self.script, self.key, self.capacity = script, key, float(per_minute)

    def _run(self, op: str, n: float) -> tuple[float, float]:
        try:
            wait, level = self.script(keys=[self.key], args=[self.capacity, op, n])
        except redis.RedisError as e:
            raise unavailable(e) from None
        return float(wait), float(level)

    def take(self, n: float) -> float:
        return self._run("take", n)[0]

    def available(self) -> float:
        return self._run("peek", 0)[1]

    def give_back(self, n: float) -> None:
        self._run("give", n)


class RedisRateLimiter(RateLimiter):
    """RateLimiter with its buckets in Redis: `requests` and `tokens` are key prefixes here."""

    def __init__(self, client: redis.Redis):
        self.script = client.register_script(BUCKET)
        self.requests, self.tokens = f"{PREFIX}rpm:", f"{PREFIX}tpm:"

    def _bucket(self, table: str, tenant_id: str, per_minute: int) -> RedisBucket:
        return RedisBucket(self.script, table + tenant_id, per_minute)


class RedisSpendGuard(SpendGuard):
    def __init__(self, ledger: Ledger, client: redis.Redis, heartbeat_ms: int = 15_000):
        self.ledger, self.client, self.heartbeat_ms = ledger, client, heartbeat_ms
        self.holder = uuid.uuid4().hex
        self._spend, self._release = client.register_script(SPEND), client.register_script(RELEASE)
        self._mirror, self._seed = client.register_script(MIRROR), client.register_script(SEED)
        ledger.after_commit.append(self._count)
        stop = threading.Event()
        threading.Thread(target=_heartbeat, args=(client, f"{PREFIX}holder:{self.holder}", heartbeat_ms, stop),
                         name="sluice-heartbeat", daemon=True).start()
        weakref.finalize(self, stop.set)

    @staticmethod
    def _month_keys(tenant_id: str, month: str) -> list[str]:
        """The spend mirror and the month's epoch."""
        return [f"{PREFIX}spent:{tenant_id}:{month}", f"{PREFIX}epoch:{tenant_id}:{month}"]

    @staticmethod
    def _reserved_key(tenant_id: str) -> str:
        return f"{PREFIX}reserved:{tenant_id}"

    def _run(self, tenant: Tenant, estimate: float | None) -> tuple[float, float]:
        cap = tenant.spec.limits.monthly_spend_cap_usd
        month = month_of(time.time())
        (spent, epoch), reserved = self._month_keys(tenant.id, month), self._reserved_key(tenant.id)
        try:
            while True:
                answer = self._spend(keys=[spent, reserved],
                                     args=[cap, "" if estimate is None else estimate, self.holder, self.heartbeat_ms])
                if answer[0] == b"ok":
                    return cap, float(answer[1])
                seen = self.client.get(epoch) or b"0"
                self._seed(keys=[spent, epoch], args=[self.ledger.spent(tenant.id, month), seen, MIRROR_TTL_MS])
        except redis.RedisError as e:
            raise unavailable(e) from None

    def _left(self, tenant: Tenant) -> tuple[float, float]:
        return self._run(tenant, None)

    def _take(self, tenant: Tenant, estimate: float) -> tuple[float, float]:
        return self._run(tenant, estimate)

    def release(self, tenant: Tenant, estimate: float) -> None:
        try:
            self._release(keys=[self._reserved_key(tenant.id)], args=[self.holder, estimate])
        except redis.RedisError as e:        # the heartbeat lapses with Redis gone: nothing stays held
            log.warning("could not release a reservation of tenant %r: %s", tenant.id, e)

    def _count(self, rows: list[UsageRow]) -> None:
        """After-commit hook (the ledger's writer thread): the batch's costs into the mirror."""
        spent: dict[tuple[str, str], float] = defaultdict(float)
        for row in rows:
            spent[row.tenant, row.month] += row.cost
        pipe = self.client.pipeline(transaction=False)
        for (tenant_id, month), dollars in spent.items():
            self._mirror(keys=self._month_keys(tenant_id, month), args=[dollars], client=pipe)
        try:
            pipe.execute()
        except redis.RedisError:
            # A mirror that missed these rows would undercount: drop it so the next check seeds
            # from the ledger (if Redis cannot hear that either, the mirror's expiry does it).
            with contextlib.suppress(redis.RedisError):
                self.client.delete(*(self._month_keys(t, m)[0] for t, m in spent))
            raise


def _heartbeat(client: redis.Redis, key: str, ttl_ms: int, stop: threading.Event) -> None:
    while True:
        try:
            client.set(key, 1, px=ttl_ms)
        except redis.RedisError as e:
            log.warning("heartbeat to Redis failed: %s", e)
        if stop.wait(ttl_ms / 3000):
            return
