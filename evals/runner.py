"""Run a dataset through answering modes and log every question as it finishes.

Each question is answered as /v1/ask would answer it: retrieval's rag_context composes the
context (search, trim to the context budget, prompt), the engine's chat template and
tokenizer make the prompt ids, and the engine generates greedily. Up to `concurrency`
questions are in the engine at once (continuous batching, like concurrent users), so TTFT
and latency are measured under that load.

A mode decides, call by call, which model answers a question: `small` and `large` call one
model once. `Routed` modes decide as the gateway's mode=auto does, with the router's own
policy and cascade verdict: `routed` picks the model by difficulty, `cascade` starts small
and asks for the large model after reading the small call's log-probabilities,
`routed+cascade` does both. The escalated call gets the small answer as an external draft
(router.cascade.draft_for) when the engine verifies drafts for the large model, as in the
gateway: it changes the large model's speed, never its greedy answer.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
from tqdm import tqdm

from engine.llm_engine import Completion, LLMEngine
from engine.sampling_params import SamplingParams
from evals.costs import Price, request_cost
from evals.datasets import Dataset, Example, load
from evals.metrics import Score, score
from evals.records import Call, Record, RecordLog
from retrieval import Collection, RagContext, RetrievalError, CollectionStore, rag_context
from router.cascade import draft_for, judge
from router.confidence import ConfidenceModel
from router.policy import Policy, Route, route

# The service's defaults, so an eval measures what a tenant gets: the demo tenant's context
# and output budgets (examples/tenants/demo.toml) and the gateway's retrieval_k. A test
# keeps them equal.
DEFAULT_CONTEXT_BUDGET = 2048
DEFAULT_MAX_TOKENS = 256
DEFAULT_K = 8
SALT = b"sluice-evals"        # the prefix-cache salt of the eval's one "tenant"
TENANT, COLLECTION = "evals", "corpus"
CONFIG_FILE, RECORDS_FILE = "run.json", "records.jsonl"


class RunError(ValueError):
    """A run folder that cannot be continued with these settings."""


class RunConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Everything that decides a run's answers and costs; run.json in the run folder. A
    folder resumes only under the same config; modes and concurrency may change between
    invocations (run small today, large tomorrow)."""
    dataset: str
    files: list[str]
    n: int | None
    seed: int
    models: dict[str, str]            # engine model name -> source (store name, folder or GGUF)
    prices: dict[str, Price]
    context_budget: int = DEFAULT_CONTEXT_BUDGET
    k: int = DEFAULT_K
    max_tokens: int = DEFAULT_MAX_TOKENS
    thinking_budget: int = 0          # 0: no thinking span, as /v1/ask without one
    quant: str = "none"               # both models' weights: none, int8 or int4 (engine.quantize)
    split: str = "all"                # all, or the train or test half (evals.datasets.in_split)
    mix: tuple[int, int] = (1, 1)     # mixed: SQuAD questions to GSM8K problems


class Mode(Protocol):
    name: str
    models: tuple[str, ...]           # engine models it may call

    def next_model(self, example: Example, calls: list[Call]) -> str | None:
        """The model for the question's next call, or None once `calls` hold its answer."""


@dataclass(frozen=True)
class SingleModel:
    """Every question to one model, once."""
    name: str
    model: str

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model,)

    def next_model(self, example: Example, calls: list[Call]) -> str | None:
        return None if calls else self.model


MODES: dict[str, Mode] = {"small": SingleModel("small", "small"), "large": SingleModel("large", "large")}
ROUTED_MODES = ("routed", "cascade", "routed+cascade")


@dataclass
class Routed:
    """mode=auto as the gateway decides it: router.policy.route, then router.cascade.judge."""
    name: str
    policy: Policy
    confidence: ConfidenceModel
    classifier: object | None = None        # a router DifficultyClassifier; None: the policy's default
    embedder: object | None = None          # embeds the question for the classifier
    collection: Collection | None = None    # searched for the classifier's retrieval scores
    k: int = DEFAULT_K
    _routes: dict[str, Route] = field(default_factory=dict)

    @property
    def models(self) -> tuple[str, ...]:
        return (self.policy.small, self.policy.large)

    def next_model(self, example: Example, calls: list[Call]) -> str | None:
        if not calls:
            r = self._routes[example.id] = route(self.policy, self._predict(example))
            return r.model
        r = self._routes.pop(example.id, None)
        if r is not None and len(calls) == 1 and judge(r.escalate_to, self.policy.escalation_threshold,
                                                       self.confidence, calls[0].logprobs).escalate:
            return r.escalate_to
        return None

    def _predict(self, example: Example):
        if self.classifier is None:
            return None

        def predict():
            # The runner searches again when it composes the call: an offline run pays twice for
            # what the gateway does once, and sees the same scores.
            hits = self.collection.search(example.question, self.k) if example.retrieve and self.collection else []
            return self.classifier.predict(example.question, self.embedder.encode([example.question])[0],
                                           [h.score for h in hits])
        return predict


def routed_modes(router, embedder, collection: Collection | None, k: int = DEFAULT_K,
                 threshold: float = 0.5) -> dict[str, Routed]:
    """`routed`, `cascade` and `routed+cascade` with a trained router (router.model.RouterModel,
    or None: no classifier, the default confidence rule). No time limit on the classifier
    offline: a run measures the router, not the machine's load."""
    def policy(classifier: bool, escalation: bool) -> Policy:
        return Policy("small", "large", "small", ("small", "large"), {"easy": 0, "medium": 0, "hard": 0},
                      threshold, classifier, escalation, classifier_timeout_s=3600.0)
    confidence = router.confidence if router else ConfidenceModel()
    classifier = router.classifier if router else None
    return {name: Routed(name, policy(c, e), confidence, classifier, embedder, collection, k)
            for name, c, e in (("routed", True, False), ("cascade", False, True), ("routed+cascade", True, True))}


def open_run(folder: Path, config: RunConfig) -> None:
    """Create the run folder, or check that it was made with this config."""
    path = folder / CONFIG_FILE
    if path.exists():
        old = msgspec.json.decode(path.read_bytes(), type=RunConfig)
        if old != config:
            a, b = msgspec.structs.asdict(old), msgspec.structs.asdict(config)
            diff = "; ".join(f"{k}: {a[k]!r} there, {b[k]!r} now" for k in a if a[k] != b[k])
            raise RunError(f"{folder} holds a run with other settings ({diff}); "
                           f"give another --out, or the same settings to resume it")
        return
    folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(config)) + b"\n")


def read_config(folder: Path) -> RunConfig:
    path = folder / CONFIG_FILE
    if not path.exists():
        raise RunError(f"{folder}: not a run folder (no {CONFIG_FILE})")
    return msgspec.json.decode(path.read_bytes(), type=RunConfig)


def load_dataset(config: RunConfig) -> Dataset:
    """The run's questions, the same ones every time the run is resumed."""
    return load(config.dataset, [Path(f) for f in config.files], config.n, config.seed, config.split, config.mix)


def build_collection(folder: Path, dataset: Dataset, embedder, progress: bool = True) -> Collection:
    """The dataset's documents as one collection in the run folder, embedded once: documents
    already stored (an earlier, interrupted invocation) are not embedded again."""
    collection = CollectionStore(folder / "collections", embedder).collection(TENANT, COLLECTION)
    have = set(collection.doc_ids())
    missing = [d for d in dataset.documents if d.id not in have]
    with tqdm(total=len(dataset.documents), initial=len(dataset.documents) - len(missing), desc="collection",
              unit="doc", disable=not progress) as bar:
        for i in range(0, len(missing), 32):
            collection.ingest(missing[i:i + 32])
            bar.update(len(missing[i:i + 32]))
    return collection


def run_modes(folder: Path, config: RunConfig, examples: list[Example], modes: list[Mode], engine: LLMEngine,
              collection: Collection | None = None, concurrency: int = 8, progress: bool = True) -> None:
    """Each mode over the examples in turn, logged to the run folder's records."""
    log = RecordLog(folder / RECORDS_FILE)
    try:
        runner = Runner(engine, config, log, collection, concurrency, progress)
        for mode in modes:
            runner.run(mode, examples)
    finally:
        log.close()


@dataclass
class _Question:
    """A question while its calls run."""
    example: Example
    calls: list[Call] = field(default_factory=list)
    context: RagContext | None = None
    retrieval_s: float = 0.0
    prompt_tokens: int = 0
    engine_s: float = 0.0            # of the call in flight
    answer: str = ""
    error: str | None = None
    last: Completion | None = None   # the previous call's, a draft for an escalation


class Runner:
    def __init__(self, engine: LLMEngine, config: RunConfig, log: RecordLog, collection: Collection | None = None,
                 concurrency: int = 8, progress: bool = True):
        self.engine, self.config, self.log = engine, config, log
        self.collection, self.concurrency, self.progress = collection, concurrency, progress

    def run(self, mode: Mode, examples: list[Example]) -> None:
        """Answer every example not yet logged for this mode; each is logged as it finishes."""
        todo = deque(e for e in examples if not self.log.done(mode.name, e.id))
        inflight: dict[str, _Question] = {}
        ready: list[tuple[_Question, str, list[int]]] = []     # calls composed, not yet in the engine
        bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc=mode.name, unit="q",
                   disable=not self.progress)

        def advance(q: _Question) -> None:
            """Compose the question's next call, or log it once its mode has the answer."""
            model = mode.next_model(q.example, q.calls)
            if model is not None and (ids := self._compose(q, model)) is not None:
                ready.append((q, model, ids))
            else:
                self.log.append(self._record(mode, q))
                bar.update(1)

        try:
            while todo or inflight or ready:
                while todo and len(inflight) + len(ready) < self.concurrency:
                    advance(_Question(todo.popleft()))
                # Into the engine together, right before a step: a request's clock starts when
                # it arrives, so composing the others' contexts must not run on it.
                for q, model, ids in ready:
                    request_id = self._submit(q, model, ids)
                    if request_id is None:
                        self.log.append(self._record(mode, q))
                        bar.update(1)
                    else:
                        inflight[request_id] = q
                ready.clear()
                if not inflight:
                    continue
                start = time.perf_counter()
                outputs = self.engine.step()
                share = (time.perf_counter() - start) / len(inflight)
                for q in inflight.values():      # the step's time, split among those it served
                    q.engine_s += share
                for out in outputs:
                    if out.completion is not None:
                        q = inflight.pop(out.request_id)
                        q.calls.append(self._call(q, out.completion))
                        q.answer, q.last = out.completion.text, out.completion
                        advance(q)
        finally:
            for request_id in inflight:          # interrupted: leave the engine as we found it
                self.engine.abort(request_id)
            bar.close()

    def _compose(self, q: _Question, model: str) -> list[int] | None:
        """The call's prompt ids, composed as /v1/ask composes them; None (q.error set) when refused."""
        ex, cfg = q.example, self.config
        start = time.perf_counter()
        worker = self.engine.worker(model)
        try:
            q.context = rag_context(self.collection if ex.retrieve else None, ex.question, cfg.context_budget,
                                    worker.tokenizer, cfg.k)
        except RetrievalError as e:
            q.error = f"retrieval refused: {e}"
            return None
        ids = worker.tokenizer.encode(self.engine.chat_prompt(q.context.messages, model,
                                                              thinking=cfg.thinking_budget > 0))
        q.retrieval_s = time.perf_counter() - start
        if len(ids) >= worker.cfg.max_position:
            q.error = f"the prompt is {len(ids)} tokens; model {model!r} reads at most {worker.cfg.max_position - 1}"
            return None
        return ids

    def _submit(self, q: _Question, model: str, ids: list[int]) -> str | None:
        cfg = self.config
        params = SamplingParams(max_tokens=cfg.max_tokens,
                                thinking_budget=cfg.thinking_budget if cfg.thinking_budget > 0 else None)
        try:
            request_id = self.engine.add_request(ids, params, model=model, salt=SALT,
                                                 draft=q.last and draft_for(self.engine, model, q.last))
        except ValueError as e:
            q.error = f"the engine refused it: {e}"
            return None
        q.prompt_tokens, q.engine_s = len(ids), 0.0
        return request_id

    def _call(self, q: _Question, c: Completion) -> Call:
        # Tokens as the usage ledger counts them: the prompt we sent, every generated token.
        output = len(c.token_ids)
        cost = request_cost(self.config.prices[c.model], q.prompt_tokens, c.num_cached_tokens, output)
        return Call(c.model, q.prompt_tokens, c.num_cached_tokens, output, c.num_thinking_tokens, cost,
                    q.retrieval_s, c.ttft, c.latency, q.engine_s, c.finish_reason,
                    [round(x, 4) for x in c.logprobs])

    def _record(self, mode: Mode, q: _Question) -> Record:
        ex, ctx = q.example, q.context
        if q.error is None:
            s, answer = score(ex.kind, q.answer, ex.answers), q.answer
        else:                                    # not answered: scored as wrong
            s, answer = Score(0.0, None if ex.kind == "gsm8k" else 0.0), ""
        return Record(mode.name, ex.id, ex.kind, ex.question, answer, s.em, s.f1, s.value, s.correct,
                      len(q.calls) > 1, len(ctx.citations) if ctx else 0, ctx.trimmed.tokens if ctx else 0,
                      [round(h.score, 4) for h in ctx.hits] if ctx else [], q.calls, q.error)
