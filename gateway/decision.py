"""The route decision: which model answers, and why. This is the one place a route is
chosen. For mode=auto with the router installed, the router's policy (router/policy.py)
decides from the question, its embedding and the retrieval scores; after the first answer
the cascade (router/cascade.py) adds its confidence and whether it escalated."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from gateway.errors import GatewayError
from gateway.tenants import Tenant
from router.classifier import Difficulty
from router.policy import Policy, route

MODES = ("auto", "small", "large")


@dataclass(frozen=True)
class Decision:
    model: str
    reason: str
    difficulty: str | None = None       # easy | medium | hard, once a router says so
    thinking_budget: int = 0
    confidence: float | None = None     # calibrated chance the answer is right, after generation
    escalated: bool = False
    escalate_to: str | None = None      # where a low-confidence answer goes; None: it stands
    source: str = "client"              # what chose the model: client | no_router | classifier | policy | fallback


def policy_of(tenant: Tenant, small: str, large: str) -> Policy:
    spec, r = tenant.spec, tenant.spec.router
    return Policy(small, large, spec.default_model, tuple(spec.allowed_models),
                  msgspec.structs.asdict(spec.thinking_budget), spec.escalation_threshold,
                  r.classifier, r.escalation, r.models, r.max_thinking_budget, r.classifier_timeout_ms / 1000)


def decide(tenant: Tenant, mode: str, field: str = "mode", models: tuple[str, str] | None = None,
           predict: Callable[[], Difficulty] | None = None) -> Decision:
    """`models`: the (small, large) pair when the router is installed, None when it is not;
    `predict` runs the difficulty classifier (None: none loaded). `field` names the request
    field that carried the mode."""
    if mode == "auto":
        if models is None:
            return Decision(tenant.spec.default_model, "router not installed; tenant default", source="no_router")
        r = route(policy_of(tenant, *models), predict)
        return Decision(r.model, r.reason, r.difficulty, r.thinking_budget, escalate_to=r.escalate_to, source=r.source)
    if mode not in tenant.spec.allowed_models:
        raise GatewayError(403, f"tenant {tenant.id!r} may not use model {mode!r}; allowed: "
                                f"{', '.join(['auto', *tenant.spec.allowed_models])}", field, "model_not_allowed")
    return Decision(mode, "requested by the client")
