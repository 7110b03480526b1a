"""The answer pipeline, above the router and retrieval, below the gateway and evals: one path
from a question to its engine calls and their price (pipeline/answer.py)."""
from .answer import Answer, EngineCall, Pipeline, Plan, Query, Refused, Terms, call_cost
from .prices import Price, cost, default_prices, parse_price

__all__ = ["Answer", "EngineCall", "Pipeline", "Plan", "Price", "Query", "Refused", "Terms", "call_cost", "cost",
           "default_prices", "parse_price"]
