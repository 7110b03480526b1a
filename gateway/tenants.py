"""Tenants: one TOML file each in a folder, validated into typed structs, re-read on change.

The tenant's id is its file name without `.toml`. The folder is checked at most once per
`interval` seconds, on request; a file whose mtime, size or inode changed is read again.
A broken edit keeps the last good version of that tenant (a broken new file adds nothing)
and is logged and shown in metrics until it is fixed; a removed file removes its tenant.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from engine import KVWindow, ThinkingExit
from gateway.config import ConfigError, NonNegative, Positive, load_toml
from pipeline import CacheTerms, Terms
from pipeline.prices import Dollars
from router.policy import Policy

log = logging.getLogger("sluice.tenants")

TENANT_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
Sha256Hex = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$",
                                        description="sha256 of the key, 64 lowercase hex digits")]


class ThinkingBudgets(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The tenant file's [thinking_budget] table: the thinking tokens the router gives a
    question of each difficulty (Policy.thinking; a router with arms takes the largest as its
    cap on the arms). A request's own thinking_budget may ask for up to the largest
    (Terms.client_thinking_cap). With `early_exit`, thinking stops once its answer has settled,
    as `exit` says (engine/early_exit.py)."""
    easy: NonNegative = 0
    medium: NonNegative = 0
    hard: NonNegative = 0
    early_exit: bool = False
    exit: ThinkingExit = ThinkingExit()

    @property
    def per_difficulty(self) -> dict[str, int]:
        return {"easy": self.easy, "medium": self.medium, "hard": self.hard}


class RouterSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How mode=auto routes this tenant's questions (docs/gateway.md); every part can be switched off."""
    classifier: bool = True              # false: the default model answers first, always
    escalation: bool = True              # false: the first answer stands
    models: Literal["auto", "never_large", "always_large"] = "auto"
    # Caps the thinking the router picks (Policy.router_thinking_cap), below [thinking_budget];
    # a request's own thinking_budget is held to [thinking_budget]'s largest, not to this.
    max_thinking_budget: NonNegative | None = None
    classifier_timeout_ms: Positive = 50                # slower: tenant default, and the reason says so
    # A trained router with an early model judges the small answer on its first tokens too,
    # and cuts a doomed one short; false: only whole answers are judged.
    early_escalation: bool = True
    # A router trained with arms (small, large, large with thinking) takes the cheapest arm whose
    # predicted P(correct) is within this of the best allowed arm's: 0 buys the best, 1 the cheapest.
    arm_margin: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05
    # The same for closed-book questions (nothing searched), where the arms differ in thinking;
    # unset: arm_margin.
    closed_book_arm_margin: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    # A narrow arm's answer (large@256: the best passage alone) judged under escalation_threshold
    # is asked again of the same model with a wider context; false: it stands.
    widen: bool = True
    # true: the wider context leads with the narrow one's passages, whose prompt the prefix cache
    # then serves (cheaper, but it scored lower on the report); false: the plain arm's order.
    widen_from_cache: bool = False


class LongContext(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A chat whose conversation alone is over the context budget: "reject" answers 422
    (over_context_budget); "window" answers it from the conversation alone (no passages) while
    the engine keeps the KV of its first `sinks` tokens and its most recent ones, `window`
    tokens in all (StreamingLLM's attention sinks), dropping the rest as it streams through.
    Checked against the engine's default 16-token blocks (the engine checks its own again)."""
    policy: Literal["reject", "window"] = "reject"
    sinks: int = 4
    window: Positive | None = None          # tokens a query attends to at most; None: the context budget

    def kv_window(self, context_budget: int) -> KVWindow | None:
        return KVWindow(self.sinks, self.window or context_budget) if self.policy == "window" else None


WINDOW_BLOCK_SIZE = 16      # EngineConfig.block_size's default


class Limits(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    requests_per_minute: Positive
    tokens_per_minute: Positive          # prompt plus output tokens
    monthly_spend_cap_usd: Dollars       # calendar month, UTC
    # Seconds from arrival to the last token (504 past it); absent: the server's request_timeout_s.
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # Bytes of one file uploaded (POST /v1/collections/{name}/files) or ingested by the CLI.
    max_file_bytes: Positive = 16 * 2**20


class AnswerCacheSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The answer cache (docs/gateway.md): a repeated question answered from a finished answer
    to it, made from the same documents, for this tenant alone."""
    enabled: bool = False
    ttl_s: Annotated[float, msgspec.Meta(gt=0)] = 86_400.0     # seconds an answer is served for
    # true: also a question that asks the same in other framing ("can you tell me ...", articles,
    # contractions) over the same passages, its embedding within `similarity` (cosine) of the cached one's
    near_duplicates: bool = False
    similarity: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    hit_price_usd: Dollars = 0.0         # billed for an answer served from the cache


class TenantSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What a tenant file holds. Every field is documented in examples/tenants/demo.toml."""
    name: str = ""
    api_key_sha256: Annotated[list[Sha256Hex], msgspec.Meta(min_length=1)]
    default_model: str
    allowed_models: Annotated[list[str], msgspec.Meta(min_length=1)]
    context_budget: Positive             # tokens of system message, passages and question
    # true: the hits are cut to their sentences that bear on the question before the budget is
    # filled (more answers fit a small budget); false: whole passages, in an order questions
    # over the same passages share, so the prefix cache serves more of each prompt.
    passage_selection: bool = True
    output_budget: Positive              # most output tokens one request may ask for
    thinking_budget: ThinkingBudgets = ThinkingBudgets()     # the [thinking_budget] table
    escalation_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5
    prefix_cache_salt: Annotated[str, msgspec.Meta(min_length=8)]
    router: RouterSettings = RouterSettings()
    long_context: LongContext = LongContext()
    limits: Limits
    answer_cache: AnswerCacheSettings = AnswerCacheSettings()

    def __post_init__(self) -> None:
        if self.default_model not in self.allowed_models:
            raise ValueError(f"field 'default_model': expected one of allowed_models "
                             f"({', '.join(self.allowed_models)}), got {self.default_model!r}")
        if errors := self.thinking_budget.exit.errors():
            raise ValueError("; ".join(f"field 'thinking_budget.exit.{key}': {message}" for key, message in errors))
        window = self.long_context.kv_window(self.context_budget)
        if window is not None and (errors := window.errors(WINDOW_BLOCK_SIZE, 2**31)):
            raise ValueError("; ".join(f"field 'long_context.{key}': {message}" for key, message in errors))


@dataclass(frozen=True)
class Tenant:
    id: str
    spec: TenantSpec
    salt: bytes                 # the engine's prefix-cache salt for this tenant's requests
    key_digests: tuple[bytes, ...]

    @cached_property
    def terms(self) -> Terms:
        """The tenant file as the answer pipeline applies it."""
        spec, r = self.spec, self.spec.router
        policy = Policy(spec.default_model, tuple(spec.allowed_models), spec.thinking_budget.per_difficulty,
                        spec.escalation_threshold, r.classifier, r.escalation, r.models, r.max_thinking_budget,
                        r.classifier_timeout_ms / 1000, r.early_escalation, r.arm_margin, r.closed_book_arm_margin,
                        r.widen, r.widen_from_cache)
        c = spec.answer_cache
        cache = CacheTerms(c.enabled, c.ttl_s, c.near_duplicates, c.similarity, c.hit_price_usd)
        return Terms(self.id, policy, spec.context_budget, spec.output_budget, self.salt, spec.passage_selection,
                     cache, spec.long_context.kv_window(spec.context_budget),
                     spec.thinking_budget.exit if spec.thinking_budget.early_exit else None)


def load_tenant(path: Path, served_models: set[str]) -> Tenant:
    """One tenant from its file, or ConfigError naming the file, the field and what was expected."""
    tenant_id = path.stem
    if not TENANT_ID.fullmatch(tenant_id):
        raise ConfigError(f"{path}: the file name is the tenant id and must match {TENANT_ID.pattern} "
                          f"(lowercase letters, digits, '_' or '-')")
    spec = load_toml(path, TenantSpec)
    unknown = [m for m in spec.allowed_models if m not in served_models]
    if unknown:
        raise ConfigError(f"{path}: field 'allowed_models': {', '.join(map(repr, unknown))} not served; "
                          f"expected a subset of {sorted(served_models)}")
    return Tenant(tenant_id, spec, spec.prefix_cache_salt.encode(),
                  tuple(bytes.fromhex(h) for h in spec.api_key_sha256))


class TenantRegistry:
    def __init__(self, folder: str | Path, served_models: set[str], interval: float = 1.0):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConfigError(f"{self.folder}: tenants folder not found")
        self.served_models = served_models
        self.interval = interval
        self.tenants: dict[str, Tenant] = {}
        self.errors: dict[str, str] = {}           # file name -> why its current content is refused
        self.reloads = {"ok": 0, "error": 0}
        self._seen: dict[Path, tuple[int, int, int]] = {}
        self._keys: list[tuple[bytes, Tenant]] = []
        self._checked = float("-inf")
        self._lock = threading.Lock()              # the CLI and tests may refresh from threads
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < self.interval:
            return
        with self._lock:
            self._checked = now
            stats = {}
            for p in sorted(self.folder.glob("*.toml")):
                try:
                    st = p.stat()
                    stats[p] = (st.st_mtime_ns, st.st_size, st.st_ino)
                except FileNotFoundError:       # removed while we looked
                    pass
            changed = [p for p, s in stats.items() if self._seen.get(p) != s]
            removed = [p for p in self._seen if p not in stats]
            if not changed and not removed:
                return
            for p in removed:
                self.tenants.pop(p.stem, None)
                self.errors.pop(p.name, None)
                log.info("tenant %s removed (%s is gone)", p.stem, p)
            for p in changed:
                self._load(p)
            self._seen = stats
            self._keys = [(d, t) for t in self.tenants.values() for d in t.key_digests]

    def _load(self, path: Path) -> None:
        try:
            tenant = load_tenant(path, self.served_models)
            clash = {t.id for t in self.tenants.values() if t.id != tenant.id
                     and set(t.key_digests) & set(tenant.key_digests)}
            if clash:
                raise ConfigError(f"{path}: field 'api_key_sha256': a key is already used by tenant "
                                  f"{', '.join(sorted(clash))}; expected keys unique to this tenant")
        except ConfigError as e:
            self.errors[path.name] = str(e)
            self.reloads["error"] += 1
            kept = "keeping its last good version" if path.stem in self.tenants else "tenant not loaded"
            log.error("tenant file refused (%s): %s", kept, e)
            return
        self.errors.pop(path.name, None)
        self.reloads["ok"] += 1
        self.tenants[tenant.id] = tenant

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant whose key hashes to the same digest, compared in constant time against
        every key, so timing tells nothing about which keys exist."""
        self.refresh()
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known, tenant in self._keys:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    def get(self, tenant_id: str) -> Tenant | None:
        self.refresh()
        return self.tenants.get(tenant_id)


def check_folder(folder: str | Path, served_models: set[str]) -> tuple[list[Tenant], dict[str, str]]:
    """For `sluice tenants check`: every tenant that loads, and every file's error."""
    registry = TenantRegistry(folder, served_models)
    return sorted(registry.tenants.values(), key=lambda t: t.id), dict(registry.errors)
