"""What the Ray Serve ingress hands to Sluice replicas, and the prefix key it routes them by.

A request's prefix is what its prompt shares with others before the question: the system
message (instructions and the retrieved passages, in canonical order) and any earlier turns
of a conversation, salted per tenant as the engine's prefix cache is. The ingress computes
it as the replica will, through the same pipeline (retrieval, routing, the arm's trim) over
the models' tokenizers alone (`PrefixKeys`: the question is embedded twice, a few
milliseconds of CPU, to know the prefix before routing).
Requests with the same key can reuse the blocks the last of them left in its replica's
prefix cache. A request without a prefix (no collection, no earlier turns), or one the
replica will refuse, has no key and goes to the least loaded replica.

The key travels with the request to serve_router.AffinityRouter, which keeps each key on
the replica that served it last.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import msgspec

from engine import Prompters
from gateway.config import ServerConfig
from gateway.errors import GatewayError
from gateway.http.auth import bearer_key
from gateway.service import pipeline_for
from gateway.tenants import TenantRegistry
from pipeline import Query, Refused
from retrieval import CollectionStore, Embedder, RetrievalError

# Deployment name -> this process's router for it (serve_router registers itself here, since
# Serve unpickles a router's own module by value, so that module's globals are copies).
ROUTERS: dict[str, object] = {}


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as the ingress hands it to a replica."""
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    affinity: str | None = None          # the prefix key; None: no preference


@dataclass(frozen=True)
class Pinned:
    """A call for one replica in particular (its metrics, its process id), not routed."""
    replica: str


class _Part(msgspec.Struct):
    text: str = ""


class _Message(msgspec.Struct):
    role: str
    content: str | list[_Part]


class _Prefix(msgspec.Struct):
    """What /v1/ask and /v1/chat/completions bodies say about the prompt's prefix: the
    context, and what routes it (the arm's budget, a thinking instruction)."""
    question: str = ""
    collection: str | None = None
    messages: list[_Message] = []
    mode: str = "auto"                   # /v1/ask's
    model: str = "auto"                  # /v1/chat/completions'
    thinking_budget: int | None = None


class PrefixKeys:
    """The ingress's copy of what decides a prompt's prefix: tenants, collections (read only),
    and the replicas' pipeline over the models' tokenizers."""

    def __init__(self, config: ServerConfig, tenants: Path, data: Path, embedder: Embedder | None = None):
        embedder = embedder or Embedder()
        self.tenants = TenantRegistry(tenants, set(config.engine.models), config.tenant_reload_interval_s)
        self.collections = CollectionStore(data / "collections", embedder)
        self.pipeline = pipeline_for(config, Prompters(config.engine), embedder)

    def key(self, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> str | None:
        """Blocking (embedding, search): call it from a thread."""
        if path not in ("/v1/ask", "/v1/chat/completions"):
            return None
        try:
            auth = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), None)
            tenant = self.tenants.authenticate(bearer_key(auth))
            prefix = msgspec.json.decode(body, type=_Prefix)
        except (GatewayError, msgspec.DecodeError, UnicodeDecodeError):   # the replica says what is wrong
            return None
        if tenant is None:
            return None
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                     "".join(p.text for p in m.content)} for m in prefix.messages] or None
        question = prefix.question or next((m["content"] for m in reversed(messages or []) if m["role"] == "user"), "")
        query = Query(question, messages=messages, collection=prefix.collection,
                      mode=prefix.mode if path == "/v1/ask" else prefix.model,
                      requested_thinking=prefix.thinking_budget)
        try:
            collection = None if prefix.collection is None else \
                self.collections.collection(tenant.id, prefix.collection, create=False)
            plan = self.pipeline.plan(tenant.terms, query, collection, "prefix-key")
        except (RetrievalError, Refused):
            return None
        shared = plan.context.messages[:-1]          # everything before the last message
        if not shared:
            return None
        return hashlib.sha256(tenant.salt + msgspec.json.encode(shared)).hexdigest()
