"""Accounting: the usage ledger (ledger.py: SQLite; ledger_postgres.py: PostgreSQL; rows.py:
what both store), rate limits and spend caps (limits.py: in memory; limits_redis.py: shared in
Redis), and which of them a server uses (storage.py)."""
