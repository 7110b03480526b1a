"""Labels without decoding whole answers, where that is sound: for a question with a short
reference answer (SQuAD), how readily each model would say it, from one teacher-forced pass
over the served prompt followed by the reference (`LLMEngine.score`). A label costs one prefill
per model instead of two generations.

The proxy is a guess at "this model answers it correctly": the mean log-probability of a
reference's tokens against a threshold per model, the best over the question's distinct gold
answers (SQuAD gives up to three, and its F1 and exact match take the best too). `agreement`
fits each threshold on the questions a run also generated answers for and reports how often
the proxy agrees with the generated correctness, so a label file built from the proxy says how
far it can be trusted.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from engine import LLMEngine
from evals.datasets import Example
from evals.records import RecordLog, complete_lines
from evals.runner import MODES, RECORDS_FILE, RunConfig, RunError
from pipeline import Pipeline, Query, Refused

PROXY_FILE, PROXY_REPORT = "proxy.jsonl", "proxy.json"


class ProxyScore(msgspec.Struct, frozen=True):
    id: str
    model: str
    mean_logprob: float | None        # of the reference's tokens; None: the prompt was refused
    tokens: int
    retrieval_scores: list[float] = []   # the search's hits, by rank, as labels keep them
    answer: int = 0                   # which of the example's gold answers (the first distinct of its text)
    prompt: int = 0                   # the prompt's tokens (what the arm would pay for); 0 in files from before


class Agreement(msgspec.Struct, frozen=True):
    model: str
    questions: int                    # with both a proxy score and a generated answer
    threshold: float                  # proxy says "correct" at mean log-probability >= this
    agreement: float                  # share of questions where the proxy's verdict is the generated one
    base_rate: float                  # share generated correct: the agreement of always saying "wrong" is 1 - this
    kappa: float                      # Cohen's kappa: agreement beyond chance


@dataclass(frozen=True)
class ScoreJob:
    example: Example
    model: str
    prompt: list[int] | None          # the prompt `model` is served; None: refused
    hits: list[float]
    first_passage: str                # the chunk the prompt's passages open with; "" without any
    answers: tuple[int, ...] = (0,)   # the gold answers to score, by index


def distinct_answers(example: Example) -> list[int]:
    """The index of each gold answer whose text no earlier one has: annotators often agree."""
    seen: dict[str, int] = {}
    for i, a in enumerate(example.answers):
        seen.setdefault(a.strip(), i)
    return sorted(seen.values())


def plan_score(pipeline: Pipeline, config: RunConfig, example: Example, model: str, collection,
               answers: tuple[int, ...] = (0,)) -> ScoreJob:
    """The prompt `model` is served for the question, through the answers' own pipeline."""
    query = Query(example.question, endpoint="eval", mode=model, max_output_tokens=config.max_tokens,
                  requested_thinking=0)
    try:
        plan = pipeline.plan(MODES[model].terms(config), query, collection if example.retrieve else None,
                             f"proxy-{model}-{example.id}")
    except Refused:
        return ScoreJob(example, model, None, [], "", answers)
    cited = plan.context.citations
    return ScoreJob(example, model, plan.prompt_ids, [round(h.score, 4) for h in plan.context.hits],
                    cited[0].hit.chunk.id if cited else "", answers)


def score_job(engine: LLMEngine, job: ScoreJob) -> list[ProxyScore]:
    """Each asked reference answer's mean token log-probability after the prompt. The first
    leaves the prompt in the prefix cache, so the others compute little more than themselves."""
    e = job.example
    if job.prompt is None:
        return [ProxyScore(e.id, job.model, None, 0, answer=i) for i in job.answers]
    out = []
    for i in job.answers:
        reference = engine.prompter(job.model).encode(e.answers[i])
        logprobs = engine.score(job.prompt + reference, job.model, first=len(job.prompt))
        out.append(ProxyScore(e.id, job.model, round(float(np.mean(logprobs)), 4), len(reference), job.hits, i,
                              len(job.prompt)))
    return out


def best_scores(scores: list[ProxyScore], examples: list[Example]) -> dict[tuple[str, str], float]:
    """By (question, model), the best mean log-probability over the question's distinct gold
    answers, where every one of them was scored (a run stopped half way through a question's
    answers would otherwise judge it on fewer); a refused prompt has none."""
    wanted = {e.id: set(distinct_answers(e)) for e in examples}
    scored: dict[tuple[str, str], set[int]] = {}
    best: dict[tuple[str, str], float] = {}
    for s in scores:
        key = (s.id, s.model)
        scored.setdefault(key, set()).add(s.answer)
        if s.mean_logprob is not None:
            best[key] = max(best.get(key, s.mean_logprob), s.mean_logprob)
    return {key: p for key, p in best.items() if key[0] in wanted and scored[key] >= wanted[key[0]]}


def scoring_order(jobs: list[ScoreJob]) -> list[ScoreJob]:
    """Grouped by the passage a prompt opens with, groups in an order hashed from it, prompt
    order within a group, a question's two models together (its label needs both)."""
    return sorted(jobs, key=lambda j: (hashlib.blake2b(j.first_passage.encode()).digest(), j.prompt or [], j.model))


def score_run(folder: Path, pipeline: Pipeline, config: RunConfig, examples: list[Example], collection,
              progress: bool = True, models: tuple[str, ...] = tuple(MODES)) -> list[ProxyScore]:
    """Proxy scores of every distinct gold answer of every SQuAD-style question for `models`
    (both by default; one where only its arm at this run's context budget is wanted),
    appended to proxy.jsonl as they come, so an interrupted run resumes (and a file
    from before every answer was scored gains the rest). Every question is planned first
    (retrieval and trimming are cheap), then scored grouped by the passage its prompt opens
    with, in prompt order within a group: questions whose passages coincide come together, and
    each prefills only past the prefix the engine's cache holds. The groups come in an order
    hashed from their passage, so a run stopped early has labelled a random sample of
    passages, not the alphabetically first."""
    path = folder / PROXY_FILE
    done = read_scores(folder, cut=True)
    have = {(s.id, s.model, s.answer) for s in done}
    todo = [(e, m, need) for e in examples if e.kind != "gsm8k" for m in models
            if (need := tuple(i for i in distinct_answers(e) if (e.id, m, i) not in have))]
    jobs = [plan_score(pipeline, config, e, m, collection, need)
            for e, m, need in tqdm(todo, desc="plan", unit="prompt", disable=not progress)]
    jobs = scoring_order(jobs)
    encoder = msgspec.json.Encoder()
    with path.open("ab") as out:
        for job in tqdm(jobs, desc="proxy", unit="prompt", disable=not progress):
            scores = score_job(pipeline.engine, job)
            out.write(b"".join(encoder.encode(s) + b"\n" for s in scores))
            out.flush()
            done += scores
    return done


def agreement(folder: Path, scores: list[ProxyScore], examples: list[Example]) -> list[Agreement]:
    """Per model, the threshold that makes the proxy agree most with the run's generated
    correctness, and how much it then agrees."""
    best = best_scores(scores, examples)
    log = RecordLog(folder / RECORDS_FILE)
    try:
        out = []
        for model in MODES:
            generated = {r.id: r.correct for r in log.of_mode(model)}
            pairs = [(p, generated[qid]) for (qid, m), p in best.items() if m == model and qid in generated]
            if len(pairs) >= 2:
                out.append(_fit(model, np.array([p for p, _ in pairs]), np.array([c for _, c in pairs])))
        return out
    finally:
        log.close()


def _fit(model: str, proxy: np.ndarray, correct: np.ndarray) -> Agreement:
    # 1.0: above any log-probability (the proxy always says wrong), and unlike inf it fits in JSON.
    candidates = np.concatenate([np.unique(proxy), [1.0]])
    agree = [float(np.mean((proxy >= t) == correct)) for t in candidates]
    best = int(np.argmax(agree))
    said = proxy >= candidates[best]
    chance = said.mean() * correct.mean() + (1 - said.mean()) * (1 - correct.mean())
    kappa = (agree[best] - chance) / (1 - chance) if chance < 1 else 0.0
    return Agreement(model, len(proxy), float(candidates[best]), agree[best], float(correct.mean()), float(kappa))


def read_scores(folder: Path, cut: bool = False) -> list[ProxyScore]:
    """The run's proxy scores; `cut`: a torn last line is cut off the file (before appending)."""
    decoder = msgspec.json.Decoder(ProxyScore)
    return [decoder.decode(line) for line in complete_lines(folder / PROXY_FILE, cut)]


def read_thresholds(path: Path) -> dict[str, float]:
    """The thresholds `agreement` fitted, by model: from a run folder's proxy.json, or such a
    file kept elsewhere (docs/router/proxy-agreement.json)."""
    if path.is_dir():
        path = path / PROXY_REPORT
    if not path.exists():
        raise RunError(f"{path}: no such file; run `python -m evals proxy RUN` on a run with generated answers")
    try:
        found = {a.model: a.threshold for a in msgspec.json.decode(path.read_bytes(), type=list[Agreement])}
    except msgspec.DecodeError as e:
        raise RunError(f"{path}: not a proxy agreement file: {e}") from None
    if not {"small", "large"} <= set(found):
        raise RunError(f"{path}: thresholds for {sorted(found) or 'no model'}; labels need small and large "
                       f"(fit them on a run that generated answers with both)")
    return found
