"""The route decision: which model answers, and why. This is the one place a route is
chosen; the router (router/, not built yet) plugs in here by replacing the `auto` branch
with its difficulty, thinking budget and, after the answer, its confidence and escalation."""
from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import GatewayError
from gateway.tenants import Tenant

MODES = ("auto", "small", "large")


@dataclass(frozen=True)
class Decision:
    model: str
    reason: str
    difficulty: str | None = None       # easy | medium | hard, once a router says so
    thinking_budget: int = 0
    confidence: float | None = None     # calibrated chance the answer is right, after generation
    escalated: bool = False


def decide(tenant: Tenant, mode: str, field: str = "mode") -> Decision:
    """Today only the mode and the tenant decide; the router will also read the question and
    the retrieval scores. `field` names the request field that carried the mode."""
    if mode == "auto":
        return Decision(tenant.spec.default_model, "router not installed; tenant default")
    if mode not in tenant.spec.allowed_models:
        raise GatewayError(403, f"tenant {tenant.id!r} may not use model {mode!r}; allowed: "
                                f"{', '.join(['auto', *tenant.spec.allowed_models])}", field, "model_not_allowed")
    return Decision(mode, "requested by the client")
