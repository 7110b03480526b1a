"""The answer cache: a finished answer kept so that the same question is not answered twice.

A wrong hit is made impossible by what the key holds, not by checks after the fact. The
exact key is a digest of: the tenant; the server's models (`namespace`); the tenant's terms
that shape an answer (budgets, policy, passage selection); the collection and its revision
(a new one at every ingest or delete, read before retrieval, so an answer is never filed
under content newer than it was made from); the normalized question (Unicode NFKC, case
folded, whitespace collapsed, a trailing question mark dropped); and every request field
that changes the answer (mode, output and thinking budgets, stop sequences, the chat
history, and for a sampled answer its temperature, top_p and seed). Keys are stored under
the tenant's own prefix. What the pipeline stores is a finished answer only (answer.py,
`Pipeline.remember`); a sampled request without a seed is neither looked up nor stored.

Near duplicates (a tenant's opt-in) are found after retrieval: a question whose embedding is
within the tenant's `similarity` (cosine) of a cached question's, whose retrieval put the
same passages in the prompt (they are part of the group's key), and which the guard
(answer_guard.py) finds to ask the same thing in other framing.

A store that cannot be reached (Redis restarting) is a miss and a skipped write, never an
error: the request is answered as if nothing were cached.
"""
from __future__ import annotations

import hashlib
import logging
import time
import unicodedata
from dataclasses import dataclass

import msgspec
import numpy as np

from pipeline.answer_guard import blocked, signature
from pipeline.answer_store import Store, StoreUnavailable

log = logging.getLogger("sluice.answer_cache")
NEAR_KEEP = 32                  # candidates kept per near-duplicate group (same fields, same passages)


@dataclass(frozen=True)
class CacheTerms:
    """A tenant's answer cache settings ([answer_cache] in its budget file)."""
    enabled: bool = False
    ttl_s: float = 86_400.0
    near_duplicates: bool = False
    similarity: float = 0.9
    hit_price: float = 0.0               # dollars billed for an answer served from the cache


class CachedPassage(msgspec.Struct, array_like=True):
    number: int
    chunk_id: str
    doc_id: str
    title: str
    score: float


class Entry(msgspec.Struct, array_like=True):
    """A finished answer, with what made it (for the response, the ledger and checks)."""
    tenant: str
    collection: str | None
    revision: str | None                 # the collection's when it was looked up, before retrieval
    request_id: str                      # of the request that made it
    question: str                        # as asked
    text: str
    finish_reason: str
    model: str
    reason: str
    difficulty: str | None
    confidence: float | None
    escalated: bool
    arm: str | None
    citations: list[CachedPassage]
    cited: list[int]
    trimmed: tuple[int, int, int, int]  # kept, dropped, tokens, budget
    tokens: tuple[int, int, int, int]   # prompt, cached, completion, thinking: what making it took
    cost: float                          # dollars making it cost
    created: float                       # time.time()


class Near(msgspec.Struct, array_like=True):
    key: str
    question: str
    vector: bytes                        # float32, unit length


@dataclass
class Lookup:
    """One request's place in the cache: where its answer would be filed."""
    tenant: str
    terms: CacheTerms
    key: str
    group: str | None                    # near duplicates: the group's key but for the passages; None: off
    question: str
    collection: str | None
    revision: str | None
    vector: np.ndarray | None = None     # set by planning, with the passages, for near duplicates
    passages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hit:
    entry: Entry
    match: str                           # exact | near
    age_s: float
    similarity: float | None = None      # near: the cosine to the cached question


def normalize(text: str) -> str:
    """NFKC, case folded, whitespace collapsed, without a trailing question mark: nothing that
    changes what is asked."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split()).removesuffix("?").rstrip()


def digest(value) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(value)).hexdigest()[:40]


ENTRY = msgspec.msgpack.Decoder(Entry)
NEAR = msgspec.msgpack.Decoder(Near)


class AnswerCache:
    def __init__(self, store: Store, namespace: str = ""):
        """`namespace`: what the server answers with (its models, its router), so that entries in
        a shared store made by another configuration are never read."""
        self.store, self.namespace = store, namespace
        self.errors = 0                  # store failures, each answered uncached
        self._failing = False

    def lookup(self, tenant: str, terms: CacheTerms, fields: dict, question: str, collection: str | None,
               revision: str | None, near: bool) -> tuple[Lookup, Hit | None]:
        """The request's key and its exact hit, if any. `fields`: everything but the question
        that changes the answer; `near`: whether the request may take a near duplicate's."""
        fields = {**fields, "namespace": self.namespace, "collection": collection, "revision": revision}
        key = f"{tenant}:{digest({**fields, 'question': normalize(question)})}"
        group = f"{tenant}:near:{digest(fields)}" if near and terms.near_duplicates else None
        found = Lookup(tenant, terms, key, group, question, collection, revision)
        entry = self._entry(key)
        return found, self._fresh(found, entry, "exact")

    def near(self, lookup: Lookup) -> Hit | None:
        """The freshest cached answer to a near duplicate of the question (`lookup.vector` and
        `lookup.passages` set), or None."""
        if lookup.group is None or lookup.vector is None:
            return None
        try:
            records = [NEAR.decode(r) for r in self.store.members(self._group(lookup))]
        except StoreUnavailable as e:
            self._failed(e)
            return None
        asked = signature(lookup.question)
        for r in reversed(records):      # newest first
            similarity = float(np.frombuffer(r.vector, np.float32) @ lookup.vector)
            if similarity >= lookup.terms.similarity and blocked(signature(r.question), asked) is None:
                hit = self._fresh(lookup, self._entry(r.key), "near")
                if hit is not None:
                    return Hit(hit.entry, "near", hit.age_s, round(similarity, 4))
        return None

    def remember(self, lookup: Lookup, entry: Entry) -> bool:
        """File a finished answer under the lookup's key (and its near-duplicate group)."""
        try:
            self.store.put(lookup.key, msgspec.msgpack.encode(entry), lookup.terms.ttl_s)
            if lookup.group is not None and lookup.vector is not None:
                record = Near(lookup.key, lookup.question, np.asarray(lookup.vector, np.float32).tobytes())
                self.store.append(self._group(lookup), msgspec.msgpack.encode(record), lookup.terms.ttl_s, NEAR_KEEP)
        except StoreUnavailable as e:
            self._failed(e)
            return False
        self._failing = False
        return True

    def stats(self) -> dict[str, int]:
        return self.store.stats()

    def _group(self, lookup: Lookup) -> str:
        return f"{lookup.group}:{digest(sorted(lookup.passages))}"

    def _entry(self, key: str) -> Entry | None:
        try:
            raw = self.store.get(key)
        except StoreUnavailable as e:
            self._failed(e)
            return None
        self._failing = False
        try:
            return None if raw is None else ENTRY.decode(raw)
        except msgspec.DecodeError:      # written by another version of this code: a miss
            return None

    def _fresh(self, lookup: Lookup, entry: Entry | None, match: str) -> Hit | None:
        """A hit if the entry is the tenant's, from the same revision, and within its TTL now
        (a TTL lowered by a tenant file's reload applies to what is stored already)."""
        if entry is None or (entry.tenant, entry.collection, entry.revision) != \
                (lookup.tenant, lookup.collection, lookup.revision):
            return None
        age = time.time() - entry.created
        return Hit(entry, match, max(0.0, age)) if age <= lookup.terms.ttl_s else None

    def _failed(self, e: StoreUnavailable) -> None:
        self.errors += 1
        if not self._failing:
            log.warning("answer cache store unavailable, answering uncached: %s", e)
        self._failing = True
