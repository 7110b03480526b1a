"""The answer pipeline, above the router and retrieval, below the gateway and evals: one path
from a question to its engine calls (answer.py), the one loop that drives them through the
engine (driver.py), and their price (prices.py)."""
from .answer import Answer, EngineCall, Models, Pipeline, Plan, Query, Refused, Terms, call_cost
from .answer_cache import AnswerCache, CacheTerms, Entry, Hit, Lookup
from .answer_store import MemoryStore, RedisStore, StoreUnavailable
from .driver import DeadlineExceeded, Judged, Progress, Text, drive
from .prices import Price, cost, default_prices, parse_price

__all__ = ["Answer", "AnswerCache", "CacheTerms", "DeadlineExceeded", "Entry", "Hit", "Lookup", "MemoryStore",
           "RedisStore", "StoreUnavailable", "EngineCall", "Judged", "Models", "Pipeline", "Plan", "Price", "Progress",
           "Query", "Refused", "Terms", "Text", "call_cost", "cost", "default_prices", "drive", "parse_price"]
