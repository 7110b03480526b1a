"""A tenant's routing policy: difficulty -> model and thinking budget, when to escalate, and
the tenant's overrides. The gateway builds a Policy from the tenant file; evals build one
from a run's settings; the answer pipeline (pipeline/) is the one caller of `route`. Every
Route says in words why it went where it went.

No single point of failure: the classifier is optional, and one that is missing, raises or
runs past its time limit leaves the tenant's default model in charge, and the reason says so.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from router.arms import Arm
from router.classifier import Difficulty

# Two workers: one classifier stuck past its time limit must not hold up the next request's.
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="router")


@dataclass(frozen=True)
class Policy:
    default_model: str                  # when no difficulty is known
    allowed: tuple[str, ...]
    thinking: dict[str, int]            # thinking tokens per difficulty
    escalation_threshold: float         # escalate when P(correct) is below it
    classifier: bool = True             # off: every question goes to the default model
    escalation: bool = True             # off: the first answer stands
    force: str = "auto"                 # auto | never_large | always_large
    router_thinking_cap: int | None = None  # caps the thinking the router picks ([router] max_thinking_budget)
    classifier_timeout_s: float = 0.05
    early_escalation: bool = True       # judge the first answer on its first tokens too (a trained router's)
    # Arms: the cheapest arm whose P(correct) is within this of the best arm's (route_arms).
    arm_margin: float = 0.05
    # The same for closed-book questions (nothing searched: GSM8K-like), whose arms differ in
    # thinking rather than context; None: arm_margin. On retrieved questions the cheap arms are
    # nearly as good, so a wide margin pays; on closed-book ones it gives up thinking that pays.
    closed_book_margin: float | None = None
    widen: bool = True                  # an unsure answer of a narrow arm is asked again with a wider context
    # On: the wider context leads with the narrow one's passages, so the prefix cache serves
    # that part. Off by default: on the report's widened SQuAD questions the lead cost 12% less
    # and scored lower F1, a dearer trade than a lower threshold (benchmarks/results/widen_order.json).
    widen_from_cache: bool = False


@dataclass(frozen=True)
class Route:
    """Where a question goes, and after its first answer whether it went further: the one
    decision record from the router to the HTTP response and the ledger."""
    model: str                          # the model whose answer stands (the escalation's, once escalated)
    reason: str
    difficulty: str | None = None
    probability: float | None = None    # the classifier's calibrated probability of `difficulty`
    thinking_tokens: int = 0            # the thinking span the route picked; 0: none
    # The model a low-confidence answer goes to; None: it stands. The arm's own model when the
    # arm widens (a narrow arm with a confidence model of its own): the same question again,
    # with a wider context.
    escalate_to: str | None = None
    # what chose the model: client | no_router | classifier | arms | policy | fallback
    source: str = "classifier"
    # Calibrated chance the answer is right: the arm model's before the first call, the
    # cascade's verdict on the first answer once judged.
    confidence: float | None = None
    escalated: bool = False
    arm: str | None = None              # the arm the router chose (router.arms); None: not routed by arms
    context_budget: int | None = None   # the arm's own context budget, when below the tenant's


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


def route(p: Policy, small: str, large: str, predict: Callable[[], Difficulty] | None) -> Route:
    """Where one question goes, between the engine's cheap `small` and strong `large` model.
    `predict` runs the difficulty classifier (None: none loaded)."""
    difficulty, failure = (None, "classifier off for this tenant") if not p.classifier else \
        classify(predict, p.classifier_timeout_s)
    return _by_difficulty(p, small, large, difficulty, failure)


def _escalation(p: Policy, model: str, small: str, large: str, narrow: bool = False) -> str | None:
    """Where an unsure first answer goes: a small one to the large model; a narrow arm's
    (`narrow`: it has a confidence model of its own) to its own model with a wider context."""
    if not (p.escalation and p.escalation_threshold > 0):
        return None
    if narrow:
        return model if p.widen else None
    large_ok = large in p.allowed and p.force != "never_large"
    return large if large_ok and model == small != large else None


def route_arms(p: Policy, arms: tuple[Arm, ...], small: str, large: str,
               predict: Callable[[], dict[str, float]] | None, cost: Callable[[Arm], float],
               narrow: frozenset[str] = frozenset(), retrieved: bool = True) -> Route:
    """The cheapest arm whose predicted P(correct) is within the tenant's margin of the best
    arm's, among those the tenant allows: its models, its largest [thinking_budget] (and
    max_thinking_budget) as a cap on thinking, never_large / always_large. `predict` gives
    P(correct) per arm name; `cost(arm)` the expected dollars at the server's prices. When the
    arm model is off, slow or broken, the tenant's default as `route` falls back. `narrow`: the
    arms whose answers have a confidence model (router.confidence.train_narrow); an unsure one
    is escalated to the same model with a wider context, where the tenant allows
    escalation and widening. `retrieved`: the question's kind (router.arms.retrieved), which
    picks the margin."""
    probs, failure = (None, "classifier off for this tenant") if not p.classifier else \
        classify(predict, p.classifier_timeout_s)
    if probs is None:
        return _by_difficulty(p, small, large, None, failure)
    if not probs:
        return _by_difficulty(p, small, large, None, "no arm was trained on this kind of question")
    cap = max(p.thinking.values())
    if p.router_thinking_cap is not None:
        cap = min(cap, p.router_thinking_cap)
    force_large = p.force == "always_large" and large in p.allowed
    ok = [a for a in arms if a.model in p.allowed and a.thinking <= cap and a.name in probs
          and not (p.force == "never_large" and a.model == large) and not (force_large and a.model != large)]
    if not ok:
        return _by_difficulty(p, small, large, None, "no arm this tenant allows")
    best = max(ok, key=lambda a: probs[a.name])
    margin = p.arm_margin if retrieved or p.closed_book_margin is None else p.closed_book_margin
    floor = probs[best.name] - margin
    arm = min((a for a in ok if probs[a.name] >= floor), key=cost)
    why = f"arms: {arm.name} (P(right) {probs[arm.name]:.2f}, ${cost(arm):.6f})"
    why += (f" is the cheapest within {margin:.2f} of the best, {best.name} ({probs[best.name]:.2f})"
            if arm != best else " is the best")
    if len(ok) < sum(a.name in probs for a in arms):      # arms of another kind of question are not offered
        why = f"{why}; of {len(ok)} arms this tenant allows"
    return Route(arm.model, why, thinking_tokens=arm.thinking,
                 escalate_to=_escalation(p, arm.model, small, large, arm.name in narrow), source="arms",
                 confidence=probs[arm.name], arm=arm.name, context_budget=arm.context_budget)


def _by_difficulty(p: Policy, small: str, large: str, difficulty: Difficulty | None, failure: str | None) -> Route:
    large_ok = large in p.allowed and p.force != "never_large"
    cap = lambda budget: budget if p.router_thinking_cap is None else min(budget, p.router_thinking_cap)
    source = "classifier" if difficulty is not None else "fallback"
    if p.force == "always_large" and large in p.allowed:
        model, why, source = large, "tenant policy: always large", "policy"
    elif difficulty is not None:
        model = large if goes_large(difficulty.label, cap(p.thinking["hard"])) else small
        why = f"classifier: {difficulty.label} (p={difficulty.probability:.2f})"
        if difficulty.label == "hard" and model == small:
            why = f"{why}; no thinking for hard questions, so the large model would not do better"
        if model == large and not large_ok:
            model, why = small, f"{why}; large model not allowed for this tenant"
    else:
        model, why = p.default_model, f"{failure}; tenant default"
        if model == large and not large_ok:
            model = small
    if model not in p.allowed:          # a default or a target the tenant may not use
        model = p.default_model
    thinking = p.thinking[difficulty.label] if difficulty else p.thinking["medium"]
    if p.router_thinking_cap is not None and thinking > p.router_thinking_cap:
        thinking, why = p.router_thinking_cap, f"{why}; thinking capped at {p.router_thinking_cap}"
    return Route(model, why, difficulty.label if difficulty else None,
                 difficulty.probability if difficulty else None, thinking, _escalation(p, model, small, large), source)
