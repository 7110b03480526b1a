"""Rate limits and the spend cap on every limiter (this process's memory, Redis): the same
token-bucket arithmetic and refusals through both, and what only a shared limiter must do:
two replicas never admit past a cap together, a commit racing the spend mirror's seed is
not lost, a dead replica's reservations are dropped, a lost Redis is a 503."""
from __future__ import annotations

import gc
import re
import threading
import time
from dataclasses import replace

import pytest

from gateway.config import ServerConfig
from gateway.errors import GatewayError
from gateway.tenants import load_tenant
from gateway.usage.limits import dollars, month_of
from gateway.usage.storage import open_storage
from tests.services import Redis, redis_url, server  # noqa: F401
from tests.test_gateway_parts import row
from tests.test_gateway_support import tenant_toml


def tenant(tmp_path, **limits):
    path = tmp_path / "tenants" / "alpha.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(tenant_toml("sk-alpha", **limits))
    return load_tenant(path, {"small", "large"})


@pytest.fixture(params=["memory", "redis"])
def storage(request, tmp_path):
    """(ledger, rates, spend) as a gateway configured with that limiter gets them."""
    limits = "memory" if request.param == "memory" else server(Redis).fresh_database()
    ledger, rates, spend = open_storage(ServerConfig(limits=limits), tmp_path)
    yield ledger, rates, spend
    ledger.close()


def refusal(call, *args) -> GatewayError:
    with pytest.raises(GatewayError) as e:
        call(*args)
    return e.value


def retry_in(e: GatewayError) -> float:
    """The wait a refusal states. The bucket refills by the wall clock, so a loaded machine
    (2 cores, an eval beside the tests) may move it by a tenth between two lines of a test."""
    return float(re.search(r"retry in ([\d.]+) s", e.message)[1])


def test_request_limit_refuses_with_retry_after(storage, tmp_path):
    _, rates, _ = storage
    alpha = tenant(tmp_path, rpm=3)
    for _ in range(3):
        rates.take_request(alpha)
    e = refusal(rates.take_request, alpha)
    assert e.status == 429 and e.code == "rate_limit_requests" and "limit of 3 requests per minute" in e.message
    assert float(e.headers["Retry-After"]) >= 1 and "retry in 20.0 s" in e.message


def test_token_bucket_runs_into_debt_settles_and_follows_a_resize(storage, tmp_path):
    _, rates, _ = storage
    alpha = tenant(tmp_path, tpm=60)                       # one token a second
    rates.take_tokens(alpha, 100)                          # needs a full bucket, then owes 40
    assert rates.tokens_empty(alpha) == pytest.approx(41.0, abs=0.1)
    e = refusal(rates.take_tokens, alpha, 1)
    assert e.status == 429 and e.code == "rate_limit_tokens" and retry_in(e) == pytest.approx(41.0, abs=0.3)
    rates.settle_tokens(alpha, 100, 40)                    # 60 of the reservation come back: 20
    rates.take_tokens(alpha, 20)
    assert retry_in(refusal(rates.take_tokens, alpha, 1)) == pytest.approx(1.0, abs=0.3)
    rates.settle_tokens(alpha, 20, 10)                     # 10
    smaller = tenant(tmp_path, tpm=30)                     # an edit to the file: the level stays
    assert rates.tokens_empty(smaller) == 0
    e = refusal(rates.take_tokens, smaller, 30)            # the whole (new) bucket: 20 more at 0.5 a second
    assert "limit of 30 tokens per minute" in e.message and retry_in(e) == pytest.approx(40.0, abs=0.3)


def test_buckets_refill_with_time(storage, tmp_path):
    _, rates, _ = storage
    alpha = tenant(tmp_path, rpm=600)                      # ten a second
    start, taken = time.monotonic(), 0
    while True:
        try:
            rates.take_request(alpha)
        except GatewayError as e:
            assert e.status == 429
            break
        taken += 1
    assert 600 <= taken <= 600 + 10 * (time.monotonic() - start) + 1
    time.sleep(0.25)
    rates.take_request(alpha)
    rates.take_request(alpha)


def test_spend_cap_reserves_the_worst_case_and_counts_committed_rows(storage, tmp_path):
    ledger, _, spend = storage
    alpha = tenant(tmp_path, cap=1.0)

    def commit(cost: float) -> None:
        """A request ends: its row is committed (and counted, as the writer thread does)."""
        done = replace(row(len(ledger.rows()), cost=cost), month=month_of(time.time()))
        ledger.db.write([done])
        for hook in ledger.after_commit:
            hook([done])

    spend.check_open(alpha)
    spend.reserve(alpha, 0.375)
    spend.reserve(alpha, 0.375)
    e = refusal(spend.reserve, alpha, 0.375)
    assert e.status == 402 and e.code == "spend_cap_reached"
    assert f"has {dollars(0.25)} left of its monthly cap of {dollars(1.0)}" in e.message
    commit(0.5)                                            # the first cost more than its share...
    spend.release(alpha, 0.375)                            # ...and gives back its reservation
    assert f"has {dollars(0.125)} left" in refusal(spend.reserve, alpha, 0.25).message
    commit(0.5)
    spend.release(alpha, 0.375)
    e = refusal(spend.check_open, alpha)
    assert e.status == 402 and "has spent its monthly cap of $1.00" in e.message


def test_two_replicas_never_reserve_past_the_cap_together(tmp_path, redis_url):
    """Two gateways' limiters on one Redis, 100 reservations racing from 8 threads: exactly
    as many fit as the cap holds (in memory each replica would admit that many on its own)."""
    alpha = tenant(tmp_path, cap=1.0)
    replicas = [open_storage(ServerConfig(limits=redis_url), tmp_path / f"r{i}") for i in range(2)]
    admitted, lock = [], threading.Lock()

    def client(i: int) -> None:
        for n in range(i, 100, 8):
            try:
                replicas[n % 2][2].reserve(alpha, 0.03)
                with lock:
                    admitted.append(n)
            except GatewayError as e:
                assert e.status == 402

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(admitted) == 33 and {n % 2 for n in admitted} == {0, 1}


def test_a_commit_while_the_mirror_is_seeded_is_not_lost(tmp_path, redis_url):
    """The mirror is missing (a fresh Redis): the seed reads the ledger, but a row commits
    between that read and the seed's write. The epoch makes the seed read again."""
    alpha = tenant(tmp_path, cap=1.0)
    ledger, _, spend = open_storage(ServerConfig(limits=redis_url), tmp_path)
    read = ledger.spent
    late = replace(row(1, cost=0.6), month=month_of(time.time()))

    def spent_then_a_commit_lands(tenant_id: str, month: str) -> float:
        total = read(tenant_id, month)
        if not ledger.rows():
            ledger.db.write([late])                        # what the writer thread does
            for hook in ledger.after_commit:
                hook([late])
        return total

    ledger.spent = spent_then_a_commit_lands
    e = refusal(spend.reserve, alpha, 0.5)
    assert f"has {dollars(0.4)} left" in e.message         # not 1.0: the late row counts


def test_a_dead_replicas_reservations_are_dropped_when_its_heartbeat_lapses(tmp_path, redis_url):
    from gateway.usage.limits_redis import RedisSpendGuard, connect
    alpha = tenant(tmp_path, cap=1.0)
    ledger, _, alive = open_storage(ServerConfig(limits=redis_url), tmp_path)
    dying = RedisSpendGuard(ledger, connect(redis_url), heartbeat_ms=300)
    dying.reserve(alpha, 0.9)
    assert f"has {dollars(0.1)} left" in refusal(alive.reserve, alpha, 0.5).message
    time.sleep(0.5)
    refusal(alive.reserve, alpha, 0.5)                     # alive, its heartbeat keeps it held
    ledger.after_commit.clear()
    del dying
    gc.collect()                                           # its heartbeat thread stops, as at a crash
    time.sleep(0.5)
    alive.reserve(alpha, 0.5)


def test_an_unreachable_redis_is_a_503_not_a_hang(tmp_path):
    from tests.services import free_port
    _, rates, spend = open_storage(ServerConfig(limits=f"redis://127.0.0.1:{free_port()}"), tmp_path)
    alpha = tenant(tmp_path)
    for call, args in ((rates.take_request, (alpha,)), (spend.reserve, (alpha, 0.1)), (spend.check_open, (alpha,))):
        e = refusal(call, *args)
        assert e.status == 503 and e.code == "limits_unavailable" and "Redis" in e.message
