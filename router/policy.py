"""A tenant's routing policy: difficulty -> model and thinking budget, when to escalate, and
the tenant's overrides. The gateway builds a Policy from the tenant file; evals build one
from a run's settings. Every Route says in words why it went where it went.

No single point of failure: the classifier is optional, and one that is missing, raises or
runs past its time limit leaves the tenant's default model in charge, and the reason says so.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass

from router.classifier import Difficulty

# Two workers: one classifier stuck past its time limit must not hold up the next request's.
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="router")


@dataclass(frozen=True)
class Policy:
    small: str                          # engine model names of the cheap and the strong model
    large: str
    default_model: str                  # when no difficulty is known
    allowed: tuple[str, ...]
    thinking: dict[str, int]            # thinking tokens per difficulty
    escalation_threshold: float         # escalate when P(correct) is below it
    classifier: bool = True             # off: every question goes to the default model
    escalation: bool = True             # off: the first answer stands
    force: str = "auto"                 # auto | never_large | always_large
    max_thinking: int | None = None     # a cap over every thinking budget
    classifier_timeout_s: float = 0.05


@dataclass(frozen=True)
class Route:
    model: str
    reason: str
    difficulty: str | None = None
    probability: float | None = None    # the classifier's calibrated probability of `difficulty`
    thinking_budget: int = 0
    escalate_to: str | None = None      # the model a low-confidence answer goes to; None: it stands
    source: str = "classifier"          # what chose the model: classifier | policy | fallback


def goes_large(difficulty: str, hard_thinking: int) -> bool:
    """Whether a question of this difficulty is worth the large model. By the labels'
    definition the large model answers medium questions the small one gets wrong, and hard
    ones neither answers without thinking: those go large only when the tenant gives them
    thinking tokens, else the large model's price buys nothing."""
    return difficulty == "medium" or (difficulty == "hard" and hard_thinking > 0)


def classify(predict: Callable[[], Difficulty] | None, timeout_s: float) -> tuple[Difficulty | None, str | None]:
    """The classifier's answer within its time limit, or None and why not."""
    if predict is None:
        return None, "no classifier trained"
    future = _pool.submit(predict)
    try:
        return future.result(timeout=timeout_s), None
    except FutureTimeout:
        future.cancel()
        return None, f"classifier slower than {timeout_s * 1000:.0f} ms"
    except Exception as e:              # a broken model must cost one fallback, not the request
        return None, f"classifier failed ({type(e).__name__}: {e})"


def route(policy: Policy, predict: Callable[[], Difficulty] | None) -> Route:
    """Where one question goes. `predict` runs the difficulty classifier (None: none loaded)."""
    p = policy
    difficulty, failure = (None, "classifier off for this tenant") if not p.classifier else \
        classify(predict, p.classifier_timeout_s)
    large_ok = p.large in p.allowed and p.force != "never_large"
    cap = lambda budget: budget if p.max_thinking is None else min(budget, p.max_thinking)
    source = "classifier" if difficulty is not None else "fallback"
    if p.force == "always_large" and p.large in p.allowed:
        model, why, source = p.large, "tenant policy: always large", "policy"
    elif difficulty is not None:
        model = p.large if goes_large(difficulty.label, cap(p.thinking["hard"])) else p.small
        why = f"classifier: {difficulty.label} (p={difficulty.probability:.2f})"
        if difficulty.label == "hard" and model == p.small:
            why = f"{why}; no thinking for hard questions, so the large model would not do better"
        if model == p.large and not large_ok:
            model, why = p.small, f"{why}; large model not allowed for this tenant"
    else:
        model, why = p.default_model, f"{failure}; tenant default"
        if model == p.large and not large_ok:
            model = p.small
    if model not in p.allowed:          # a default or a target the tenant may not use
        model = p.default_model
    thinking = p.thinking[difficulty.label] if difficulty else p.thinking["medium"]
    if p.max_thinking is not None and thinking > p.max_thinking:
        thinking, why = p.max_thinking, f"{why}; thinking capped at {p.max_thinking}"
    escalate = p.large if (p.escalation and large_ok and model == p.small != p.large
                           and p.escalation_threshold > 0) else None
    return Route(model, why, difficulty.label if difficulty else None,
                 difficulty.probability if difficulty else None, thinking, escalate, source)
