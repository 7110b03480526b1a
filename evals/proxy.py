"""Labels without decoding whole answers, where that is sound: for a question with a short
reference answer (SQuAD), how readily each model would say it, from one teacher-forced pass
over the served prompt followed by the reference (`LLMEngine.score`). A label costs one prefill
per model instead of two generations.

The proxy is a guess at "this model answers it correctly": the mean log-probability of the
reference's tokens against a threshold per model. `agreement` fits each threshold on the
questions a run also generated answers for and reports how often the proxy agrees with the
generated correctness, so a label file built from the proxy says how far it can be trusted.
"""
from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from evals.datasets import Example
from evals.records import RecordLog
from evals.runner import MODES, RECORDS_FILE, RunConfig, RunError
from pipeline import Pipeline, Query, Refused

PROXY_FILE, PROXY_REPORT = "proxy.jsonl", "proxy.json"


class ProxyScore(msgspec.Struct, frozen=True):
    id: str
    model: str
    mean_logprob: float | None        # of the reference's tokens; None: the prompt was refused
    tokens: int
    retrieval_scores: list[float] = []   # the search's hits, by rank, as labels keep them


class Agreement(msgspec.Struct, frozen=True):
    model: str
    questions: int                    # with both a proxy score and a generated answer
    threshold: float                  # proxy says "correct" at mean log-probability >= this
    agreement: float                  # share of questions where the proxy's verdict is the generated one
    base_rate: float                  # share generated correct: the agreement of always saying "wrong" is 1 - this
    kappa: float                      # Cohen's kappa: agreement beyond chance


def reference_score(pipeline: Pipeline, config: RunConfig, example: Example, model: str, collection) -> ProxyScore:
    """The reference answer's mean token log-probability after the prompt `model` is served."""
    mode = MODES[model]
    query = Query(example.question, endpoint="eval", mode=model, max_output_tokens=config.max_tokens,
                  thinking_budget=0)
    try:
        plan = pipeline.plan(mode.terms(config), query, collection if example.retrieve else None,
                             f"proxy-{model}-{example.id}")
    except Refused:
        return ProxyScore(example.id, model, None, 0)
    engine = pipeline.engine
    reference = engine.worker(model).tokenizer.encode(example.answers[0])
    logprobs = engine.score(plan.prompt_ids + reference, model)[len(plan.prompt_ids) - 1:]
    return ProxyScore(example.id, model, round(float(np.mean(logprobs)), 4), len(reference),
                      [round(h.score, 4) for h in plan.context.hits])


def score_run(folder: Path, pipeline: Pipeline, config: RunConfig, examples: list[Example], collection,
              progress: bool = True) -> list[ProxyScore]:
    """Proxy scores of every SQuAD-style question for both models, appended to proxy.jsonl as
    they come, so an interrupted run resumes."""
    path = folder / PROXY_FILE
    done = read_scores(folder)
    have = {(s.id, s.model) for s in done}
    todo = [(e, m) for e in examples if e.kind != "gsm8k" for m in MODES if (e.id, m) not in have]
    encoder = msgspec.json.Encoder()
    with path.open("ab") as out:
        for example, model in tqdm(todo, desc="proxy", unit="score", disable=not progress):
            score = reference_score(pipeline, config, example, model, collection)
            out.write(encoder.encode(score) + b"\n")
            out.flush()
            done.append(score)
    return done


def agreement(folder: Path, scores: list[ProxyScore]) -> list[Agreement]:
    """Per model, the threshold that makes the proxy agree most with the run's generated
    correctness, and how much it then agrees."""
    log = RecordLog(folder / RECORDS_FILE)
    try:
        out = []
        for model in MODES:
            generated = {r.id: r.correct for r in log.of_mode(model)}
            pairs = [(s.mean_logprob, generated[s.id]) for s in scores
                     if s.model == model and s.id in generated and s.mean_logprob is not None]
            if len(pairs) >= 2:
                out.append(_fit(model, np.array([p for p, _ in pairs]), np.array([c for _, c in pairs])))
        return out
    finally:
        log.close()


def _fit(model: str, proxy: np.ndarray, correct: np.ndarray) -> Agreement:
    candidates = np.concatenate([np.unique(proxy), [np.inf]])
    agree = [float(np.mean((proxy >= t) == correct)) for t in candidates]
    best = int(np.argmax(agree))
    said = proxy >= candidates[best]
    chance = said.mean() * correct.mean() + (1 - said.mean()) * (1 - correct.mean())
    kappa = (agree[best] - chance) / (1 - chance) if chance < 1 else 0.0
    return Agreement(model, len(proxy), float(candidates[best]), agree[best], float(correct.mean()), float(kappa))


def read_scores(folder: Path) -> list[ProxyScore]:
    path = folder / PROXY_FILE
    if not path.exists():
        return []
    decoder = msgspec.json.Decoder(ProxyScore)
    # A torn last line (killed mid-write) is that score not yet made.
    lines = path.read_bytes().splitlines()
    out = []
    for n, line in enumerate(lines):
        try:
            out.append(decoder.decode(line))
        except msgspec.DecodeError:
            if n < len(lines) - 1:
                raise
    return out


def read_thresholds(folder: Path) -> dict[str, float]:
    """The thresholds `agreement` fitted in a run folder, by model."""
    path = folder / PROXY_REPORT
    if not path.exists():
        raise RunError(f"{folder}: no {PROXY_REPORT}; run `python -m evals proxy {folder}` on a run with generated answers")
    return {a.model: a.threshold for a in msgspec.json.decode(path.read_bytes(), type=list[Agreement])}
