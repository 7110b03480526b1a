"""What a request costs: per-model prices per million input, cached input and output tokens.
The gateway's ledger and the evals price every engine call with `cost`, so an eval's dollars
are what the ledger would have charged for the same calls."""
from __future__ import annotations

from typing import Annotated

import msgspec

Dollars = Annotated[float, msgspec.Meta(ge=0)]


class Price(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """US dollars per million tokens."""
    input: Dollars            # prompt tokens computed anew
    cached_input: Dollars     # prompt tokens served from the prefix cache
    output: Dollars           # generated tokens, thinking included


# Stated defaults, in the range of hosted models of these sizes (late 2025 list prices):
# cached input at a quarter of input, output at four times input.
def default_prices() -> dict[str, Price]:
    return {"small": Price(input=0.10, cached_input=0.025, output=0.40),
            "large": Price(input=0.30, cached_input=0.075, output=1.20)}


def cost(price: Price, prompt: int, cached: int, output: int) -> float:
    """Dollars for one engine call; `cached` is the part of `prompt` the prefix cache served."""
    return ((prompt - cached) * price.input + cached * price.cached_input + output * price.output) / 1e6


def parse_price(text: str) -> tuple[str, Price]:
    """"MODEL=INPUT,CACHED,OUTPUT" (dollars per million tokens), as --price takes it."""
    model, sep, numbers = text.partition("=")
    parts = numbers.split(",")
    if not sep or not model or len(parts) != 3:
        raise ValueError(f"bad price {text!r}: expected MODEL=INPUT,CACHED_INPUT,OUTPUT, e.g. small=0.1,0.025,0.4")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"bad price {text!r}: the three prices must be numbers") from None
    if any(v < 0 for v in values):
        raise ValueError(f"bad price {text!r}: prices cannot be negative")
    return model, Price(*values)
