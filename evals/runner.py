"""Run a dataset through answering modes and log every question as it finishes.

Each question goes through the answer pipeline (pipeline/), the same code /v1/ask answers
with: retrieval composes and trims the context, the router routes, the cascade says which
engine call comes next, the calls run through the gateway's own driver (pipeline.drive) on
the async engine, and they are priced as the ledger prices them. The engine generates
greedily. Up to `concurrency` questions are in the engine at once (continuous batching, like
concurrent users), so TTFT and latency are measured under that load.

A mode is what /v1/ask's `mode` would be: `small` and `large` name a model; `routed`,
`cascade` and `routed+cascade` are mode=auto with the router's classifier, its escalation, or
both switched on, as a tenant's [router] section switches them.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import msgspec
from tqdm import tqdm

from engine import AsyncEngine, Completion, EngineFailure, LLMEngine, ThinkingExit
from evals.datasets import Dataset, Example, load
from evals.metrics import Score, score
from evals.records import Call, Record, RecordLog, read_records
from pipeline import Answer, Pipeline, Price, Progress, Query, Refused, Terms, call_cost, drive
from retrieval import Collection, CollectionStore
from router.policy import Policy

# The service's defaults, so an eval measures what a tenant gets: the demo tenant's context
# and output budgets (examples/tenants/demo.toml) and the gateway's retrieval_k. A test
# keeps them equal.
DEFAULT_CONTEXT_BUDGET = 2048
DEFAULT_MAX_TOKENS = 256
DEFAULT_K = 8
# The most thinking an arm-routed mode may pick: every arm router.arms offers.
ARM_THINKING_CAP = 1024
SALT = b"sluice-evals"        # the prefix-cache salt of the eval's one "tenant" (per mode: Mode.terms)
TENANT, COLLECTION = "evals", "corpus"
CONFIG_FILE, RECORDS_FILE, MODES_FILE = "run.json", "records.jsonl", "modes.json"
PAIR = ("small", "large")     # the engine's model names in a run


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
    thinking_budget: int = 0          # 0: no thinking span, as /v1/ask with thinking_budget 0
    quant: str = "none"               # both models' weights: none, int8 or int4 (engine.quantize)
    split: str = "all"                # all, or the train or test half (evals.datasets.in_split)
    mix: tuple[int, int] = (1, 1)     # mixed: SQuAD questions to GSM8K problems
    selection: bool = False           # passages cut to what bears on the question, as a tenant's passage_selection
    thinking_exit: ThinkingExit | None = None   # early exit from thinking, as a tenant's [thinking_budget] exit


@dataclass(frozen=True)
class Mode:
    name: str
    model: str = "auto"               # /v1/ask's mode: a model's name, or auto (the router decides)
    classifier: bool = False          # auto only: the tenant's [router] switches
    escalation: bool = False
    threshold: float = 0.5            # escalate when the first answer's P(correct) is below it
    margin: float = 0.05              # arms: the cheapest within this of the best arm's P(correct)
    force: str = "auto"               # which models the router may pick: a tenant's [router] models
    closed_book_margin: float | None = None   # `margin` on closed-book questions; None: margin
    widen_from_cache: bool = False    # a tenant's [router] widen_from_cache

    @property
    def models(self) -> tuple[str, ...]:
        """Engine models it may call."""
        return PAIR if self.model == "auto" else (self.model,)

    def terms(self, config: RunConfig, arms: bool = False) -> Terms:
        """The run's one tenant, as this mode sees it. No time limit on the classifier offline:
        a run measures the router, not the machine's load. `arms`: a router with arms routes
        this mode, and may pick any of them (thinking included) at the margin `threshold`."""
        # The tenant allows the run's own thinking budget (the client's, on every request), and
        # arms up to ARM_THINKING_CAP.
        thinking = {"easy": 0, "medium": 0, "hard": max(config.thinking_budget, ARM_THINKING_CAP if arms else 0)}
        policy = Policy("small", PAIR, thinking, self.threshold, self.classifier, self.escalation, self.force,
                        classifier_timeout_s=3600.0, arm_margin=self.margin,
                        closed_book_margin=self.closed_book_margin, widen_from_cache=self.widen_from_cache)
        # Each mode its own prefix-cache namespace: a mode run after another in the same engine
        # would find that one's prompts cached, and look cheaper and faster than it is served.
        return Terms(TENANT, policy, config.context_budget, config.max_tokens, SALT + b"/" + self.name.encode(),
                     config.selection, thinking_exit=config.thinking_exit)


MODES: dict[str, Mode] = {"small": Mode("small", "small"), "large": Mode("large", "large")}
ROUTED_MODES = ("routed", "cascade", "routed+cascade")


def routed_modes(threshold: float = 0.5, margin: float = 0.05, force: str = "auto",
                 closed_book_margin: float | None = None, widen_from_cache: bool = False) -> dict[str, Mode]:
    """`routed`, `cascade` and `routed+cascade` at an escalation threshold (and, with a router
    that has arms, an arm margin, on closed-book questions too unless given one of their own,
    and the models it may pick)."""
    return {name: Mode(name, "auto", c, e, threshold, margin, force, closed_book_margin, widen_from_cache)
            for name, c, e in (("routed", True, False), ("cascade", False, True), ("routed+cascade", True, True))}


def pipeline_for(engine: LLMEngine, config: RunConfig, router=None, embedder=None) -> Pipeline:
    """The run's pipeline: the gateway's with its router installed (`router` a RouterModel,
    or None: no classifier, the stated confidence rule)."""
    return Pipeline(engine, config.prices, router, None, embedder, PAIR, config.k)


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


def check_modes(folder: Path, modes: list[Mode]) -> None:
    """Record each mode's settings in the run folder (margin, threshold, widening...), or check
    them against those it ran with: answers of one mode name at two settings would be scored as
    one. A folder from before this check records the settings it is resumed with."""
    path = folder / MODES_FILE
    saved = json.loads(path.read_text()) if path.exists() else {}
    for mode in modes:
        now, then = asdict(mode), saved.get(mode.name)
        if then is not None and then != now:
            diff = "; ".join(f"{k}: {then.get(k)!r} there, {now[k]!r} now" for k in now if then.get(k) != now[k])
            raise RunError(f"{folder} ran mode {mode.name} with other settings ({diff}); give another --out, "
                           f"or the same settings to resume it")
        saved[mode.name] = now
    path.write_text(json.dumps(saved, indent=2) + "\n")


def read_config(folder: Path) -> RunConfig:
    path = folder / CONFIG_FILE
    if not path.exists():
        raise RunError(f"{folder}: not a run folder (no {CONFIG_FILE})")
    return msgspec.json.decode(path.read_bytes(), type=RunConfig)


def reusable(folder: Path, config: RunConfig) -> dict[tuple[str, str], Record]:
    """(mode, question id) -> an answer of another run that this run would give too: that run
    differs only in a larger thinking budget, and the answer spent fewer thinking tokens than
    this run's budget, so the budget never cut it; or it differs in its draw alone (`n`), and
    its answer to any question both draws hold serves. Decoding is greedy, so both runs write
    the same tokens (up to the rounding of a different batch), and the answer is copied rather
    than generated again: a 256-token label is free wherever the 1,024-token answer thought
    less, and a larger draw pays only for its new questions. Single-model modes only: a routed
    mode's route depends on its own run. A copy keeps the other run's timings (engine seconds,
    latency), measured at that run's concurrency. The other run's log is only read: it may
    still be writing."""
    theirs = read_config(folder)
    budget, same = config.thinking_budget, msgspec.structs.replace(theirs, thinking_budget=config.thinking_budget,
                                                                  n=config.n) == config
    if not same or not (budget == theirs.thinking_budget or 0 < budget < theirs.thinking_budget):
        raise RunError(f"--reuse {folder}: its answers serve only a run with the same settings, a smaller thinking "
                       f"budget than its {theirs.thinking_budget} or another draw size (-n) (this run's budget: "
                       f"{budget})")
    records = read_records(folder / RECORDS_FILE)
    return {(r.mode, r.id): replace(r, copied_from=str(folder)) for r in records
            if r.mode in MODES and r.calls and r.error is None
            and (budget == theirs.thinking_budget or all(c.thinking_tokens < budget for c in r.calls))}


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


def run_modes(folder: Path, config: RunConfig, examples: list[Example], modes: list[Mode], pipeline: Pipeline,
              collection: Collection | None = None, concurrency: int = 8, progress: bool = True,
              reuse: dict[tuple[str, str], Record] | None = None) -> None:
    """Each mode over the examples in turn, logged to the run folder's records; `reuse`
    (`reusable`): answers copied in before the engine answers the rest."""
    log = RecordLog(folder / RECORDS_FILE)
    try:
        runner = Runner(pipeline, config, log, collection, concurrency, progress)
        for mode in modes:
            for e in examples:
                copy = (reuse or {}).get((mode.name, e.id))
                if copy is not None and copy.question == e.question and not log.done(mode.name, e.id):
                    log.append(copy)
            runner.run(mode, examples)
    finally:
        log.close()


@dataclass
class _Question:
    """A question while its calls run."""
    example: Example
    answer: Answer | None = None
    retrieval_s: float = 0.0         # planning: counted on its first call
    error: str | None = None


class Runner:
    def __init__(self, pipeline: Pipeline, config: RunConfig, log: RecordLog, collection: Collection | None = None,
                 concurrency: int = 8, progress: bool = True):
        self.pipeline, self.engine, self.config, self.log = pipeline, pipeline.engine, config, log
        self.collection, self.concurrency, self.progress = collection, concurrency, progress

    def run(self, mode: Mode, examples: list[Example]) -> None:
        """Answer every example not yet logged for this mode; each is logged as it finishes."""
        asyncio.run(self._run(mode, examples))

    async def _run(self, mode: Mode, examples: list[Example]) -> None:
        todo = deque(e for e in examples if not self.log.done(mode.name, e.id))
        arms = mode.model == "auto" and mode.classifier and bool(self.pipeline.arms)
        terms = mode.terms(self.config, arms)
        engine = AsyncEngine(self.engine)
        bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc=mode.name, unit="q",
                   disable=not self.progress)

        async def user() -> None:            # one of `concurrency` clients, each asking in turn
            while todo:
                q = _Question(todo.popleft())
                if self._plan(q, mode, terms, arms):
                    try:
                        async for _ in drive(q.answer, engine, Progress()):
                            pass
                    except ValueError as e:
                        q.error = f"the engine refused it: {e}"
                    except EngineFailure as e:
                        q.error = f"the engine failed: {e}"
                self.log.append(self._record(mode, q))
                bar.update(1)

        try:
            await asyncio.gather(*(user() for _ in range(self.concurrency)))
        finally:                             # interrupted: the streams have aborted their requests
            await engine.stop()
            bar.close()

    def _plan(self, q: _Question, mode: Mode, terms: Terms, arms: bool = False) -> bool:
        """Retrieve, route and compose as /v1/ask does; False (q.error set) when refused."""
        ex = q.example
        # The run's thinking budget is the client's, except where the router's arms choose it.
        thinking = None if arms else self.config.thinking_budget
        query = Query(ex.question, endpoint="eval", mode=mode.model, max_output_tokens=self.config.max_tokens,
                      requested_thinking=thinking)
        start = time.perf_counter()
        try:
            plan = self.pipeline.plan(terms, query, self.collection if ex.retrieve else None, f"{mode.name}-{ex.id}")
        except Refused as e:
            q.error = e.message
            return False
        q.answer, q.retrieval_s = self.pipeline.answer(plan), time.perf_counter() - start
        return True

    def _call(self, c: Completion, retrieval_s: float) -> Call:
        # Tokens as the usage ledger counts them: the prompt sent, every generated token.
        return Call(c.model, len(c.prompt_token_ids), c.num_cached_tokens, c.num_billed_tokens, c.num_thinking_tokens,
                    call_cost(self.config.prices[c.model], c), retrieval_s, c.ttft, c.latency, c.engine_s,
                    c.finish_reason, [round(x, 4) for x in c.logprobs], c.num_probe_tokens,
                    [[p.at, p.text, round(p.confidence, 4), p.complete, p.tokens, p.taken] for p in c.probes],
                    c.thinking_exited)

    def _record(self, mode: Mode, q: _Question) -> Record:
        ex = q.example
        ctx = q.answer.plan.context if q.answer else None
        completions = q.answer.calls if q.answer else []
        calls = [self._call(c, q.retrieval_s if i == 0 else 0.0) for i, c in enumerate(completions)]
        last = completions[-1] if completions and q.error is None else None
        if last is not None:
            s, answer = score(ex.kind, last.text, ex.answers), last.text
        else:                                    # not answered: scored as wrong
            s, answer = Score(0.0, None if ex.kind == "gsm8k" else 0.0), ""
        return Record(mode.name, ex.id, ex.kind, ex.question, answer, s.em, s.f1, s.value, s.correct,
                      len(calls) > 1, len(ctx.citations) if ctx else 0, ctx.trimmed.tokens if ctx else 0,
                      [round(h.score, 4) for h in ctx.hits] if ctx else [], calls, q.error)
