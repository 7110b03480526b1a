"""Where the answer cache keeps its bytes: this process's memory (a byte bound, least recently
used out first), or Redis that every replica shares (its own memory policy bounds it).

Both hold two kinds of value under string keys, each with a time to live: an entry (bytes),
and a short list of records (the near-duplicate candidates of one group, newest last). A
store that cannot be reached raises `StoreUnavailable`; the cache then answers uncached.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Protocol


class StoreUnavailable(Exception):
    """The store cannot be reached now; the message says why."""


class Store(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes, ttl_s: float) -> None: ...

    def members(self, key: str) -> list[bytes]: ...

    def append(self, key: str, value: bytes, ttl_s: float, keep: int) -> None:
        """Add `value` to the list at `key`, keeping its last `keep`."""

    def stats(self) -> dict[str, int]:
        """What it holds now ("bytes", "entries"), where it can say cheaply."""


class MemoryStore:
    """A dict in least-recently-used order, at most `max_bytes` of values (keys and
    bookkeeping are not counted); an expired value is dropped when it is next read."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.items: OrderedDict[str, tuple[bytes | list[bytes], int, float]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()        # the event loop and planning threads both use it

    def _read(self, key: str):
        found = self.items.get(key)
        if found is None:
            return None
        if found[2] <= time.monotonic():
            self._drop(key)
            return None
        self.items.move_to_end(key)
        return found[0]

    def _write(self, key: str, value: bytes | list[bytes], size: int, ttl_s: float) -> None:
        self._drop(key)
        if size > self.max_bytes:
            return
        self.items[key] = (value, size, time.monotonic() + ttl_s)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.items)))

    def _drop(self, key: str) -> None:
        found = self.items.pop(key, None)
        if found is not None:
            self.bytes -= found[1]

    def get(self, key: str) -> bytes | None:
        with self.lock:
            return self._read(key)

    def put(self, key: str, value: bytes, ttl_s: float) -> None:
        with self.lock:
            self._write(key, value, len(value), ttl_s)

    def members(self, key: str) -> list[bytes]:
        with self.lock:
            return list(self._read(key) or [])

    def append(self, key: str, value: bytes, ttl_s: float, keep: int) -> None:
        with self.lock:
            values = [*(self._read(key) or []), value][-keep:]
            self._write(key, values, sum(map(len, values)), ttl_s)

    def stats(self) -> dict[str, int]:
        return {"bytes": self.bytes, "entries": len(self.items)}


class RedisStore:
    """Redis, shared by replicas. Every call is one round trip (a pipeline for `append`),
    with short timeouts: the cache sits on the request's path and must never hold it up.
    After a failure the store is not tried again for `backoff_s`, so a Redis that is down
    costs a request nothing; the client reconnects by itself once it is back."""

    def __init__(self, url: str, prefix: str = "sluice:answer:", timeout_s: float = 0.25, backoff_s: float = 1.0):
        import redis
        self.redis = redis
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix, self.backoff_s = prefix, backoff_s
        self.down_until = 0.0

    def _call(self, do):
        if time.monotonic() < self.down_until:
            raise StoreUnavailable("Redis failed moments ago; not tried again yet")
        try:
            return do(self.client)
        except self.redis.RedisError as e:
            self.down_until = time.monotonic() + self.backoff_s
            raise StoreUnavailable(f"Redis cannot be reached: {e}") from None

    def get(self, key: str) -> bytes | None:
        return self._call(lambda c: c.get(self.prefix + key))

    def put(self, key: str, value: bytes, ttl_s: float) -> None:
        self._call(lambda c: c.set(self.prefix + key, value, px=max(1, int(ttl_s * 1000))))

    def members(self, key: str) -> list[bytes]:
        return self._call(lambda c: c.lrange(self.prefix + key, 0, -1))

    def append(self, key: str, value: bytes, ttl_s: float, keep: int) -> None:
        def do(c):
            k = self.prefix + key
            pipe = c.pipeline(transaction=True)
            pipe.rpush(k, value).ltrim(k, -keep, -1).pexpire(k, max(1, int(ttl_s * 1000)))
            pipe.execute()
        self._call(do)

    def stats(self) -> dict[str, int]:
        return {}
