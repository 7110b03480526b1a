"""Evals: metric code against hand-computed values, the data formats, and whole runs on a
small synthetic set with two tiny random models: costs add up per request, and a run
interrupted midway resumes without redoing a question and ends as an uninterrupted one."""
from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from evals.__main__ import main as evals_main
from evals.datasets import DatasetError, files_for, load, parse_mix
from evals.lab.labels import write_labels
from evals.metrics import same_answer, score
from evals.records import RecordLog
from evals.report import write_report
from evals.router_metrics import (
    CurvePoint,
    apgr,
    cascade_sweep,
    cost_at_quality,
    oracle_cascade,
    oracle_scores,
    threshold_sweep,
)
from evals.runner import (
    DEFAULT_CONTEXT_BUDGET,
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    MODES,
    RECORDS_FILE,
    RunConfig,
    RunError,
    build_collection,
    load_dataset,
    open_run,
    pipeline_for,
    run_modes,
)
from pipeline import Price, Query, cost, default_prices, parse_price
from retrieval import Collection
from tests.conftest import make_tiny_model
from tests.test_gateway_support import embedder  # noqa: F401  (the shared all-MiniLM embedder)

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ answer scoring

def test_score_by_kind_by_hand():
    # Citations are removed before scoring; "it is" stays: pred {it, is, denver, broncos},
    # gold {denver, broncos}: precision 1/2, recall 1 -> F1 2/3, no exact match.
    s = score("squad", "It is Denver Broncos [1].", ["Denver Broncos"])
    assert (s.em, s.f1, s.value, s.correct) == (0.0, pytest.approx(2 / 3), pytest.approx(2 / 3), True)
    assert score("qa", "The Denver Broncos [1][2]", ["Denver Broncos"]).em == 1.0
    g = score("gsm8k", "3 + 4 = 7, so she has 7 apples.", ["She has 3 + 4 = 7 apples.\n#### 7"])
    assert (g.em, g.f1, g.value, g.correct) == (1.0, None, 1.0, True)
    assert not score("gsm8k", "8", ["#### 7"]).correct
    assert same_answer("gsm8k", "The answer is 1,000.", "it's 1000") and not same_answer("gsm8k", "none", "none")
    assert same_answer("squad", "The Broncos [1]", "broncos") and not same_answer("squad", "Broncos", "Panthers")


# --------------------------------------------------------------- router metrics

def curve(xs, qualities, costs=None) -> list[CurvePoint]:
    costs = costs or [0.0] * len(xs)
    return [CurvePoint(0.0, x, q, c) for x, q, c in zip(xs, qualities, costs)]


def test_apgr_on_known_curves():
    # Random routing: quality on the straight line from small to large recovers half the gap.
    assert apgr(curve([0, 1], [0.4, 0.6]), 0.4, 0.6) == pytest.approx(0.5)
    # PGR 0, 0.8, 1 at shares 0, 0.5, 1: 0.5 * (0 + 0.8) / 2 + 0.5 * (0.8 + 1) / 2 = 0.65.
    assert apgr(curve([0, 0.5, 1], [0.4, 0.56, 0.6]), 0.4, 0.6) == pytest.approx(0.65)
    # Over a part of the range, RouteLLM divides by the span it covers: 0.2 / 0.5.
    assert apgr(curve([0, 0.5], [0.4, 0.56]), 0.4, 0.6) == pytest.approx(0.4)
    # PGR(x) = sqrt(x) finely sampled: the integral of sqrt over [0, 1] is 2/3.
    x = np.linspace(0, 1, 2001)
    assert apgr(curve(x, 0.2 + 0.5 * np.sqrt(x)), 0.2, 0.7) == pytest.approx(2 / 3, abs=1e-3)
    assert apgr(curve([0, 1], [0.5, 0.5]), 0.5, 0.5) is None


def test_threshold_sweep_by_hand():
    points = threshold_sweep(scores=[0.9, 0.1, 0.5, 0.5], small_quality=[1, 0, 0, 1], large_quality=[1, 1, 1, 0],
                             small_cost=[1, 1, 1, 1], large_cost=[3, 3, 3, 3])
    got = [(p.threshold, p.large_share, p.quality, p.cost) for p in points]
    assert got == [(0.1, 1.0, 0.75, 12.0),            # everyone to the large model
                   (0.5, 0.75, 0.5, 10.0),            # questions 0, 2, 3
                   (0.9, 0.25, 0.5, 6.0),             # question 0
                   (float("inf"), 0.0, 0.5, 4.0)]     # nobody


def test_cascade_sweep_by_hand():
    # Question 0 is routed to the large model at once; 1-3 start small, confidences 0.9, 0.2, 0.6.
    points = cascade_sweep(first_large=[True, False, False, False], confidence=[0.0, 0.9, 0.2, 0.6],
                           small_quality=[0, 1, 0, 1], large_quality=[1, 1, 1, 0],
                           small_cost=[1, 1, 1, 1], large_cost=[3, 3, 3, 3])
    got = [(round(p.threshold, 6), p.large_share, p.quality, p.cost) for p in points]
    assert got == [(0.2, 0.25, 0.75, 3 + 1 + 1 + 1),   # nothing below 0.2: no escalation
                   (0.6, 0.5, 1.0, 3 + 1 + 4 + 1),     # question 2 escalated, both its calls paid
                   (0.9, 0.75, 0.75, 3 + 1 + 4 + 4),   # 2 and 3 (whose large answer is wrong)
                   (1.0, 1.0, 0.75, 3 + 4 + 4 + 4)]    # every small answer escalated


def test_oracle_routing_bound_by_hand():
    small, large = [1, 0, 0, 0], [1, 1, 1, 0]        # 0.25 and 0.75
    points = threshold_sweep(oracle_scores(small, large), small, large, [1] * 4, [3] * 4)
    # Gains 0, 1, 1, 0: share 0 -> 0.25, share 0.5 -> 0.75 (all the gap), share 1 -> 0.75.
    assert sorted((p.large_share, p.quality) for p in points) == [(0.0, 0.25), (0.5, 0.75), (1.0, 0.75)]
    assert apgr(points, 0.25, 0.75) == pytest.approx(0.5 * (0 + 1) / 2 + 0.5 * (1 + 1) / 2)
    # 95% of 0.75 = 0.7125, reached between cost 4 (q 0.25) and cost 8 (q 0.75):
    # 4 + (0.7125 - 0.25) / 0.5 * 4 = 7.7.
    assert cost_at_quality(points, 0.95 * 0.75) == pytest.approx(7.7)
    # The oracle cascade pays every small call (4) and escalates the gains first: questions 1
    # and 2 (tied) at cost 10, quality 0.75; 95% is reached at 4 + 0.4625 / 0.5 * 6 = 9.55,
    # above the oracle router's 7.7 by what the small calls cost.
    cascade = oracle_cascade(small, large, [1] * 4, [3] * 4)
    assert cascade[0].cost == 4 and cascade[0].quality == 0.25
    assert cost_at_quality(cascade, 0.95 * 0.75) == pytest.approx(9.55)


def test_cost_at_quality_on_a_known_curve():
    c = curve([0, 0.25, 1], [0.5, 0.7, 0.8], costs=[4, 6, 12])
    assert cost_at_quality(c, 0.95 * 0.8) == pytest.approx(6 + 0.06 / 0.1 * 6)     # 9.6
    assert cost_at_quality(c, 0.5) == 4 and cost_at_quality(c, 0.45) == 4
    assert cost_at_quality(c, 0.9) is None


# ------------------------------------------------------------------------- costs

def test_request_cost_by_hand_and_prices_flag():
    # 600 fresh prompt tokens, 400 cached, 50 out: (600 * 0.1 + 400 * 0.025 + 50 * 0.4) / 1e6.
    assert cost(Price(0.1, 0.025, 0.4), 1000, 400, 50) == pytest.approx(9e-5)
    assert parse_price("large=0.15,0.0375,0.6") == ("large", Price(0.15, 0.0375, 0.6))
    for bad in ("large", "large=1,2", "=1,2,3", "large=a,b,c", "large=1,-2,3"):
        with pytest.raises(ValueError, match="bad price"):
            parse_price(bad)


def test_defaults_are_the_services():
    """Evals may not import the gateway; these keep its numbers and theirs the same."""
    from gateway.config import ServerConfig
    assert ServerConfig().prices == default_prices()
    demo = tomllib.loads((REPO / "examples" / "tenants" / "demo.toml").read_text())
    assert (DEFAULT_CONTEXT_BUDGET, DEFAULT_MAX_TOKENS) == (demo["context_budget"], demo["output_budget"])
    assert DEFAULT_K == ServerConfig().retrieval_k


# ---------------------------------------------------------------------- datasets

SQUAD = {"data": [
    {"title": "Solar_System", "paragraphs": [
        {"context": "t1 t2 t3 t4 t5 t6 t7 t8", "qas": [
            {"id": "s1", "question": "t1 t2 t3 ?", "answers": [{"text": "t4"}, {"text": "t4 t5"}]},
            {"id": "s2", "question": "t5 t6 ?", "answers": [{"text": "t7"}]}]},
        {"context": "t20 t21 t22 t23 t24", "qas": [
            {"id": "s3", "question": "t20 t21 ?", "answers": [{"text": "t22"}]}]}]},
    {"title": "Rivers", "paragraphs": [
        {"context": "t40 t41 t42 t43", "qas": [
            {"id": "s4", "question": "t40 t43 ?", "answers": [{"text": "t41"}]},
            {"id": "s5", "question": "t42 ?", "answers": [{"text": "t43"}]}]}]}]}
GSM8K = [{"question": f"t{i} t{i + 1} plus t{i + 2} ?", "answer": f"t{i} + t{i + 1}\n#### {i}"} for i in range(1, 6)]
JSONL = [{"question": "t1 t2 ?", "answers": ["t3"], "context": "t1 t2 t3 t4", "id": "a"},
         {"question": "t5 t6 ?", "answers": ["t7", "t8"], "context": "t5 t6 t7 t8"},
         {"question": "t9 ?", "answers": ["t10"]},
         {"question": "t2 t4 ?", "answers": ["t1"], "context": "t1 t2 t3 t4"},
         {"question": "t11 t12 ?", "answers": ["t13"]},
         {"question": "t6 t8 ?", "answers": ["t5"], "context": "t5 t6 t7 t8"}]


@pytest.fixture
def data(tmp_path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "squad-v1.1-dev-part-a.json").write_text(json.dumps(SQUAD))
    (folder / "gsm8k-train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    (folder / "own.jsonl").write_text("".join(json.dumps(r) + "\n" for r in JSONL))
    return folder


def test_datasets_load_sample_and_mix(data):
    squad = load("squad", files_for("squad", None, str(data)), None, 0)
    assert len(squad.documents) == 3 and {d.title for d in squad.documents} == {"Solar System", "Rivers"}
    assert sorted(e.id for e in squad.examples) == ["s1", "s2", "s3", "s4", "s5"]
    s1 = next(e for e in squad.examples if e.id == "s1")
    assert (s1.kind, s1.answers, s1.retrieve) == ("squad", ["t4", "t4 t5"], True)

    three = load("squad", files_for("squad", None, str(data)), 3, seed=7).examples
    assert three == load("squad", files_for("squad", None, str(data)), 3, seed=7).examples   # reproducible
    assert len(three) == 3 and three != load("squad", files_for("squad", None, str(data)), 3, seed=8).examples

    gsm = load("gsm8k", files_for("gsm8k", None, str(data)), None, 0)
    assert not gsm.documents and {e.id for e in gsm.examples} == {f"gsm8k-{i}" for i in range(1, 6)}
    assert all(e.kind == "gsm8k" and not e.retrieve for e in gsm.examples)

    own = load("jsonl", files_for("jsonl", str(data / "own.jsonl"), str(data)), None, 0)
    assert len(own.documents) == 2                                 # identical contexts stored once
    by_id = {e.id: e for e in own.examples}
    assert set(by_id) == {"a", "line-2", "line-3", "line-4", "line-5", "line-6"}
    assert by_id["a"].retrieve and not by_id["line-3"].retrieve and by_id["line-2"].answers == ["t7", "t8"]

    mixed = load("mixed", files_for("mixed", None, str(data)), 5, 0)
    assert [e.kind for e in mixed.examples] == ["squad", "gsm8k", "squad", "gsm8k", "squad"]
    assert len(mixed.documents) == 3
    two_to_one = load("mixed", files_for("mixed", None, str(data)), 6, 0, mix=(2, 1)).examples
    assert [e.kind for e in two_to_one] == ["squad", "squad", "gsm8k", "squad", "squad", "gsm8k"]

    # train and test halves are disjoint and together the whole set, whatever n and seed
    train = {e.id for e in load("gsm8k", files_for("gsm8k", None, str(data)), None, 1, split="train").examples}
    test = {e.id for e in load("gsm8k", files_for("gsm8k", None, str(data)), None, 2, split="test").examples}
    assert not train & test and train | test == {e.id for e in gsm.examples}
    assert train == {e.id for e in load("gsm8k", files_for("gsm8k", None, str(data)), None, 3, split="train").examples}


def test_dataset_errors_name_the_file_and_line(data, tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        files_for("squad", None, str(tmp_path / "nowhere"))
    with pytest.raises(DatasetError, match="jsonl needs --path"):
        files_for("jsonl", None, str(data))
    with pytest.raises(DatasetError, match="SQUAD:GSM8K"):
        parse_mix("2-1")
    with pytest.raises(DatasetError, match="not both 0"):
        parse_mix("0:0")
    with pytest.raises(DatasetError, match="mixed reads"):
        files_for("mixed", str(data / "own.jsonl"), str(data))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answers": ["a"]}\n\n{"question": "q2"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl line 3: .*answers"):
        load("jsonl", [bad], None, 0)
    bad.write_text('{"question": "q", "answers": ["a"], "id": "x"}\n{"question": "r", "answers": ["b"], "id": "x"}\n')
    with pytest.raises(DatasetError, match="ids repeat"):
        load("jsonl", [bad], None, 0)
    bad.write_text('{"data": [{"paragraphs": [{}]}]}')
    with pytest.raises(DatasetError, match="not SQuAD"):
        load("squad", [bad], None, 0)


def test_record_log_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / RECORDS_FILE
    whole = {"mode": "small", "id": "q1", "kind": "qa", "question": "q", "answer": "a", "em": 1.0, "f1": 1.0,
             "score": 1.0, "correct": True, "escalated": False, "passages": 0, "context_tokens": 3,
             "retrieval_scores": [], "calls": [], "error": None}
    path.write_text(json.dumps(whole) + "\n" + json.dumps({**whole, "id": "q2"})[:40])
    log = RecordLog(path)
    assert log.done("small", "q1") and not log.done("small", "q2")
    assert path.read_text().endswith("}\n")          # the torn write is gone; appends start clean
    log.append(msgspec.convert({**whole, "id": "q2"}, type=type(log.records["small", "q1"])))
    log.close()
    assert set(RecordLog(path).records) == {("small", "q1"), ("small", "q2")}


# -------------------------------------------------------------------- whole runs

@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    small = make_tiny_model(tmp_path_factory.mktemp("eval-small"), "qwen2", seed=1)
    large = make_tiny_model(tmp_path_factory.mktemp("eval-large"), "qwen2", seed=2)
    # No prefix caching: cached-token counts (and so costs) then do not depend on which
    # questions happened to run before, and an interrupted run can equal an uninterrupted one.
    return LLMEngine(EngineConfig(models={"small": ModelEntry(str(small)), "large": ModelEntry(str(large))},
                                  memory_budget_gb=1.0, max_kv_blocks=256, prefix_caching=False), progress=False)


def config_for(dataset: str, files: list[Path], **kw) -> RunConfig:
    return RunConfig(dataset, [str(f) for f in files], None, 0, {"small": "tiny-1", "large": "tiny-2"},
                     default_prices(), **{"context_budget": 160, "k": 4, "max_tokens": 4, **kw})


def run(folder: Path, config: RunConfig, engine, embedder, modes=("small", "large"), concurrency=3):
    """What `python -m evals run` does, with the test's engine and embedder; `modes`: names
    of MODES, or Mode objects."""
    dataset = load_dataset(config)
    open_run(folder, config)
    collection = build_collection(folder, dataset, embedder, progress=False) if dataset.documents else None
    try:
        run_modes(folder, config, dataset.examples, [MODES[m] if isinstance(m, str) else m for m in modes],
                  pipeline_for(engine, config), collection, concurrency, progress=False)
    finally:
        if collection is not None:
            collection.close()
    return dataset


def test_run_scores_costs_and_reports(tmp_path, data, engine, embedder):
    config = config_for("mixed", files_for("mixed", None, str(data)))
    dataset = run(tmp_path / "run", config, engine, embedder)
    summary = write_report(tmp_path / "run")
    assert write_labels(tmp_path / "run") == len(dataset.examples) == 10
    log = RecordLog(tmp_path / "run" / RECORDS_FILE)
    gold = {e.id: e for e in dataset.examples}
    for mode in ("small", "large"):
        records = log.of_mode(mode)
        assert sorted(r.id for r in records) == sorted(gold)
        for r in records:
            assert r.error is None and len(r.calls) == 1 and r.answered_by == mode and not r.escalated
            s = score(r.kind, r.answer, gold[r.id].answers)
            assert (r.em, r.f1, r.score, r.correct) == (s.em, s.f1, s.value, s.correct)
            assert (r.passages > 0) == (r.kind == "squad") == bool(r.retrieval_scores)
            c, p = r.calls[0], default_prices()[mode]
            assert 0 < c.output_tokens <= config.max_tokens and len(c.logprobs) == c.output_tokens
            assert c.cached_tokens == 0 and c.ttft <= c.latency and c.engine_s > 0
            # cost == tokens x prices, by hand
            assert c.cost == pytest.approx((c.prompt_tokens * p.input + c.output_tokens * p.output) / 1e6)
        m = summary["modes"][mode]
        # The summary's cost and tokens are the sums of the per-request ones.
        assert m["cost"]["total"] == pytest.approx(sum(r.cost for r in records), rel=1e-12)
        assert m["tokens"]["prompt"] == sum(r.calls[0].prompt_tokens for r in records)
        assert m["tokens"]["output"] == sum(r.calls[0].output_tokens for r in records)
        assert m["quality"] == pytest.approx(np.mean([r.score for r in records]), abs=1e-4)
        assert set(m["by_kind"]) == {"squad", "gsm8k"} and "f1" not in m["by_kind"]["gsm8k"]
        assert m["escalation_rate"] == 0.0 and m["ttft_s"]["p50"] <= m["ttft_s"]["p95"]
        # Per kind, the dollars add up to the mode's.
        kinds = m["by_kind"].values()
        assert all(k["calls"] == {mode: k["questions"]} and k["with_thinking"] == 0 for k in kinds)
        assert (sum(k["cost_per_1k_questions"] * k["questions"] for k in kinds)
                == pytest.approx(1000 * m["cost"]["total"]))
    # Small against large per kind: shares of the large mode's figures, and the target verdict.
    small, large = (summary["modes"][m]["by_kind"] for m in ("small", "large"))
    assert set(summary["vs_large"]) == {"small"}
    for kind, x in summary["vs_large"]["small"].items():
        assert x["quality"] == (pytest.approx(small[kind]["quality"] / large[kind]["quality"])
                                if large[kind]["quality"] else None)
        assert x["cost_per_1k_questions"] == pytest.approx(small[kind]["cost_per_1k_questions"]
                                                           / large[kind]["cost_per_1k_questions"])
        assert x["thinking_per_question"] is None     # no thinking at budget 0: no share of nothing
        assert x["target_met"] == (x["quality"] is not None and x["quality"] >= 0.95
                                   and x["cost_per_1k_questions"] <= 0.65)
    pair = summary["small_vs_large"]
    assert pair["questions"] == 10 and sum(pair["correct"].values()) == 10
    assert set(pair["router_bounds"]) == {"random", "oracle", "oracle cascade"}
    for name in ("report.md", "summary.json", "quality_cost.png", "latency.png", "labels.jsonl"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    assert "| small | 10 |" in (tmp_path / "run" / "report.md").read_text()
    label = json.loads((tmp_path / "run" / "labels.jsonl").read_text().splitlines()[0])
    small = log.records["small", label["id"]]
    assert (label["small_correct"] == small.correct
            and label["large_correct"] == log.records["large", label["id"]].correct)
    lp = small.calls[0].logprobs
    assert label["confidence"]["length"] == len(lp) and label["confidence"]["min"] == pytest.approx(min(lp), abs=1e-4)
    assert label["confidence"]["p50"] == pytest.approx(float(np.median(lp)), abs=1e-4)


def test_a_report_compares_modes_on_the_questions_all_of_them_answered(tmp_path):
    from evals.records import Call, Record
    folder = tmp_path / "run"
    open_run(folder, config_for("gsm8k", [tmp_path / "gsm8k.jsonl"]))
    log = RecordLog(folder / RECORDS_FILE)
    # The small model answered four questions, the large one (stopped at --limit 2) the first two.
    for mode, ems, dollars in (("small", [1, 0, 1, 1], 0.001), ("large", [1, 1], 0.004)):
        for i, em in enumerate(ems):
            call = Call(mode, 10, 0, 60, 0, dollars, 0.0, 0.1, 1.0, 0.5, "stop", [])
            log.append(Record(mode, f"q{i}", "gsm8k", f"q{i}", "", em, None, em, bool(em), False, 0, 0, [], [call]))
    log.close()
    summary = write_report(folder)
    assert summary["left_out"] == 2
    assert [(m["questions"], m["quality"]) for m in summary["modes"].values()] == [(2, 0.5), (2, 1.0)]
    # Half the quality at a quarter of the dollars: the target (95% at 65% or less) is missed.
    vs = summary["vs_large"]["small"]["gsm8k"]
    assert (vs["quality"], vs["cost_per_1k_questions"], vs["target_met"]) == (0.5, 0.25, False)
    text = (folder / "report.md").read_text()
    assert "over the 2 questions all of them answered (2 answered by some modes only" in text
    assert "| small | gsm8k | 50% | 25% |" in text
    # Modes that share no question cannot be compared: a clear error, not a division by zero.
    log = RecordLog(folder / RECORDS_FILE)
    log.append(Record("routed", "q9", "gsm8k", "q9", "", 1.0, None, 1.0, True, False, 0, 0, [], [call]))
    log.close()
    with pytest.raises(RunError, match="no question was answered by every mode"):
        write_report(folder)


STABLE = ("mode", "id", "kind", "question", "answer", "em", "f1", "score", "correct", "escalated", "passages",
          "context_tokens", "retrieval_scores")
CALL_STABLE = ("model", "prompt_tokens", "cached_tokens", "output_tokens", "thinking_tokens", "cost",
               "finish_reason", "logprobs")


def outcome(folder: Path) -> dict:
    """A run's records without the timings, which no two runs share."""
    return {key: ([getattr(r, f) for f in STABLE], [[getattr(c, f) for f in CALL_STABLE] for c in r.calls])
            for key, r in RecordLog(folder / RECORDS_FILE).records.items()}


def test_an_interrupted_run_resumes_without_redoing_a_question(tmp_path, data, engine, embedder, monkeypatch):
    config = config_for("jsonl", [data / "own.jsonl"])
    run(tmp_path / "whole", config, engine, embedder)

    class Killed(Exception):
        pass

    logged = []
    append = RecordLog.append

    def dies_after_four(self, record):
        if len(logged) == 4:
            raise Killed
        logged.append(record.id)
        append(self, record)

    monkeypatch.setattr(RecordLog, "append", dies_after_four)
    with pytest.raises(Killed):
        run(tmp_path / "cut", config, engine, embedder)
    monkeypatch.undo()
    assert not engine.requests                       # the interrupted run took its requests back

    asked, add = [], engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a, **kw: asked.append(1) or add(*a, **kw))
    ingested, ingest = [], Collection.ingest
    monkeypatch.setattr(Collection, "ingest", lambda self, docs: ingested.append(len(docs)) or ingest(self, docs))
    run(tmp_path / "cut", config, engine, embedder)
    assert len(asked) == 6 + 6 - 4                   # the 4 logged small answers are not asked again
    assert not ingested                              # nor is the collection embedded again
    before = outcome(tmp_path / "cut")
    assert len(before) == 12 and before == outcome(tmp_path / "whole")
    run(tmp_path / "cut", config, engine, embedder)  # finished: nothing left to do
    assert len(asked) == 8 and outcome(tmp_path / "cut") == before


def test_a_packed_run_goes_on_elsewhere_without_the_datasets_text(tmp_path, data, engine, embedder, monkeypatch):
    import gzip

    from evals.pack import PACKED_RECORDS, pack, unpack
    from evals.records import Record
    config = config_for("mixed", files_for("mixed", None, str(data)))
    run(tmp_path / "whole", config, engine, embedder)
    run(tmp_path / "half", config, engine, embedder, modes=("small",))
    assert pack(tmp_path / "half", tmp_path / "packed") == 10
    packed = (tmp_path / "packed" / PACKED_RECORDS).read_bytes()
    rows = [msgspec.json.decode(line, type=Record) for line in gzip.decompress(packed).splitlines()]
    assert len(rows) == 10 and all(r.question == "" and r.answer is not None for r in rows)
    pack(tmp_path / "half", tmp_path / "packed")
    assert (tmp_path / "packed" / PACKED_RECORDS).read_bytes() == packed     # no churn in a commit

    # A fresh machine: the run folder made again, the questions put back, the rest answered there.
    assert unpack(tmp_path / "packed", tmp_path / "there") == 10
    assert outcome(tmp_path / "there") == outcome(tmp_path / "half")
    asked, add = [], engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a, **kw: asked.append(1) or add(*a, **kw))
    run(tmp_path / "there", config, engine, embedder)
    assert len(asked) == 10 and outcome(tmp_path / "there") == outcome(tmp_path / "whole")

    with pytest.raises(RunError, match="already holds records"):
        unpack(tmp_path / "packed", tmp_path / "there")
    stranger = [msgspec.json.encode(replace(rows[0], id="not-in-the-data"))]
    (tmp_path / "packed" / PACKED_RECORDS).write_bytes(gzip.compress(b"\n".join(stranger) + b"\n"))
    with pytest.raises(RunError, match="not-in-the-data"):
        unpack(tmp_path / "packed", tmp_path / "elsewhere")


def test_command_line_refuses_bad_arguments_with_exit_2(tmp_path, data, capsys):
    def fails(argv, message):
        with pytest.raises(SystemExit) as e:
            evals_main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err

    fails(["run", "trivia"], "invalid choice: 'trivia'")
    fails(["run", "squad", "--modes", "small", "oracle"], "invalid choice: 'oracle' (choose from 'small', 'large'")
    assert evals_main(["run", "gsm8k", "--data", str(data), "--modes", "routed"]) == 2
    assert "mode routed needs --router FILE" in capsys.readouterr().err
    assert evals_main(["run", "gsm8k", "--data", str(data), "--modes", "cascade", "--router", str(tmp_path / "x")]) == 2
    assert "cannot load a router" in capsys.readouterr().err
    fails(["run", "gsm8k", "--price", "small=1,2"], "bad price")
    fails(["run", "squad", "-n", "0"], "must be at least 1")
    assert evals_main(["run", "squad", "--data", str(tmp_path / "none")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert evals_main(["run", "jsonl", "--data", str(data)]) == 2
    assert "jsonl needs --path FILE" in capsys.readouterr().err
    assert evals_main(["run", "gsm8k", "--data", str(data), "--price", "medium=1,1,1"]) == 2
    assert "--price names model 'medium'" in capsys.readouterr().err
    assert evals_main(["labels", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert evals_main(["pack", str(tmp_path), str(tmp_path / "packed")]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert evals_main(["unpack", str(tmp_path), str(tmp_path / "again")]) == 2
    assert "not a packed run" in capsys.readouterr().err
    # A run folder made with other settings is refused before any model loads.
    files = files_for("gsm8k", None, str(data))
    open_run(tmp_path / "run", RunConfig("gsm8k", [str(f.resolve()) for f in files], 3, 0,
                                         {"small": "qwen2.5-coder-0.5b", "large": "qwen2.5-coder-1.5b"},
                                         default_prices()))
    assert evals_main(["run", "gsm8k", "--data", str(data), "-n", "3", "--max-tokens", "64",
                       "--out", str(tmp_path / "run")]) == 2
    # Passage selection (on by default) is moot where nothing is searched: no mismatch there.
    err = capsys.readouterr().err
    assert "max_tokens: 256 there, 64 now" in err and "selection" not in err
    # `sluice eval` is the same command line.
    from cli import main as sluice_main
    assert sluice_main(["eval", "run", "jsonl", "--data", str(data)]) == 2
    assert "sluice eval: error: dataset jsonl needs --path FILE" in capsys.readouterr().err


def test_routed_and_cascade_modes_run_end_to_end(tmp_path, data, engine, embedder):
    from evals.runner import routed_modes
    from router.model import train
    from tests.test_router import write_labels as synthetic_labels
    router, _ = train(synthetic_labels(tmp_path / "labels.jsonl"), embedder)
    config = config_for("mixed", files_for("mixed", None, str(data)))
    dataset = load_dataset(config)
    folder = tmp_path / "run"
    open_run(folder, config)
    collection = build_collection(folder, dataset, embedder, progress=False)
    try:
        # Threshold 1: every small answer is unsure enough to escalate.
        modes = routed_modes(threshold=1.0)
        run_modes(folder, config, dataset.examples, list(modes.values()),
                  pipeline_for(engine, config, router, embedder), collection, 3, progress=False)
    finally:
        collection.close()
    log = RecordLog(folder / RECORDS_FILE)
    routed = {r.id: r for r in log.of_mode("routed")}
    assert len(routed) == len(dataset.examples) and all(len(r.calls) == 1 for r in routed.values())
    for r in log.of_mode("cascade"):
        assert [c.model for c in r.calls] == ["small", "large"] and r.escalated and r.answered_by == "large"
    for r in log.of_mode("routed+cascade"):
        first = routed[r.id].calls[0].model
        assert [c.model for c in r.calls] == (["large"] if first == "large" else ["small", "large"])

    # The trained router's curves count only questions it was not trained on.
    run_modes(folder, config, dataset.examples, [MODES["small"], MODES["large"]], pipeline_for(engine, config), None, 3,
              progress=False)
    seen = dataset.examples[0].id
    router.trained_on = frozenset({seen})
    summary = write_report(folder, router, embedder)
    trained = summary["trained_router"]
    assert (trained["questions"], trained["left_out_as_trained_on"]) == (len(dataset.examples) - 1, 1)
    # The summary counts how each kind of question was answered: every cascade answer escalated.
    for kind, k in summary["modes"]["cascade"]["by_kind"].items():
        assert k["calls"] == {"small,large": k["questions"]} and k["with_thinking"] == 0
    # The router has arms: they route first, by P(large right) - P(small right).
    assert set(trained["curves"]) == {"router: arms", "router: cascade", "router: routed+cascade"}
    assert all(c["apgr"] is None or 0 <= c["apgr"] <= 1.5 for c in trained["curves"].values())
    assert "not trained on" in (folder / "report.md").read_text()


def test_a_mode_does_not_find_an_earlier_modes_prompts_cached(tmp_path, data, embedder):
    """Modes run one after another in one engine: each starts from a cache of its own, so the
    second run of the same prompts hits exactly as often as the first did."""
    from evals.runner import Mode
    small = make_tiny_model(tmp_path / "small", "qwen2", seed=1)
    engine = LLMEngine(EngineConfig(models={"small": ModelEntry(str(small)), "large": ModelEntry(str(small))},
                                    memory_budget_gb=0.5, max_kv_blocks=256), progress=False)
    folder = tmp_path / "run"
    dataset = run(folder, config_for("squad", files_for("squad", None, str(data))), engine, embedder,
                  modes=(MODES["small"], Mode("small again", "small")))
    log = RecordLog(folder / RECORDS_FILE)
    first, again = ({r.id: r.calls[0] for r in log.of_mode(m)} for m in ("small", "small again"))
    assert first.keys() == again.keys() and len(first) == len(dataset.examples)
    assert [(again[q].prompt_tokens, again[q].cached_tokens) for q in first] == \
        [(first[q].prompt_tokens, first[q].cached_tokens) for q in first]
    assert sum(c.cached_tokens for c in again.values()) < sum(c.prompt_tokens for c in again.values()) / 2


def test_an_escalated_call_verifies_the_small_answer_and_keeps_the_large_answer(tmp_path, data, tmp_path_factory):
    from evals.__main__ import _engine
    from evals.runner import routed_modes
    config = config_for("gsm8k", files_for("gsm8k", None, str(data)))
    small = make_tiny_model(tmp_path_factory.mktemp("esc-small"), "qwen2", seed=1)
    config = msgspec.structs.replace(config, models={"small": str(small), "large": str(small)})
    cascade = routed_modes(threshold=1.0)["cascade"]
    engine = _engine(config, [cascade, MODES["large"]], 1.0)
    assert engine.config.speculative.target == "large" and not engine.config.speculative.prompt_lookup
    folder = tmp_path / "run"
    open_run(folder, config)
    examples = load_dataset(config).examples
    run_modes(folder, config, examples, [cascade, MODES["large"]], pipeline_for(engine, config), None, 2,
              progress=False)
    log = RecordLog(folder / RECORDS_FILE)
    large = {r.id: r.answer for r in log.of_mode("large")}
    escalated = [r for r in log.of_mode("cascade") if r.escalated]
    assert escalated and all(r.answer == large[r.id] for r in escalated)
    # The large model here is the small one: every drafted token is its own, so all are accepted.
    spec = engine.stats()["large"]["speculation"]
    assert spec["by_source"]["external"]["proposed"] > 0
    assert spec["by_source"]["external"]["accepted"] == spec["by_source"]["external"]["proposed"]


def test_thinking_budget_table_and_budgets_by_difficulty(tmp_path):
    from types import SimpleNamespace

    from evals.budgets import write_budget_table
    from evals.records import Call, Record
    # q4: every fixed row answered it, the routed mode (stopped earlier) did not: left out.
    ems = {("small", 0): [1, 0, 0, 0, 1], ("small", 64): [1, 0, 0, 1, 1],
           ("large", 0): [1, 1, 0, 0, 1], ("large", 64): [1, 1, 1, 1, 1]}
    verdict = {"q0": "easy", "q1": "medium", "q2": "hard", "q3": "easy"}
    folders = []
    for budget in (0, 64):
        folder = tmp_path / f"think{budget}"
        open_run(folder, config_for("gsm8k", [tmp_path / "gsm8k.jsonl"], thinking_budget=budget))
        log = RecordLog(folder / RECORDS_FILE)
        for mode in ("small", "large"):
            for i, em in enumerate(ems[(mode, budget)]):
                dollars = 0.001 * (3 if mode == "large" else 1) * (2 if budget else 1)
                call = Call(mode, 10, 0, 60, 50 if budget else 0, dollars, 0.0, 0.1, 1.0, 0.5, "stop", [])
                log.append(Record(mode, f"q{i}", "gsm8k", f"q{i}", "", em, None, em, bool(em), False, 0, 0, [], [call]))
        if not budget:      # a question only this run answered (the other stopped earlier): left out
            log.append(Record("small", "q9", "gsm8k", "q9", "", 1.0, None, 1.0, True, False, 0, 0, [], [call]))
        if budget:          # the arms router, served: large with thinking for q2 only, small elsewhere
            for i in range(4):
                call = Call("large" if i == 2 else "small", 10, 0, 60, 50 if i == 2 else 0, 0.006 if i == 2 else 0.001,
                            0.0, 0.1, 1.0, 0.5, "stop", [])
                em = float(i in (0, 2))
                log.append(Record("routed+cascade", f"q{i}", "gsm8k", f"q{i}", "", em, None, em, bool(em), False, 0, 0,
                                  [], [call]))
        log.close()
        folders.append(folder)
    router = SimpleNamespace(classifier=SimpleNamespace(
        probabilities=lambda q, v, s: {d: float(d == verdict[q]) for d in ("easy", "medium", "hard")}))
    embedder = SimpleNamespace(encode=lambda qs: np.zeros((len(qs), 4)))
    text = write_budget_table(folders, tmp_path / "out", "gsm8k", router, embedder)
    table = json.loads((tmp_path / "out" / "budgets.json").read_text())
    assert [(r["mode"], r["budget"], r["em"]) for r in table["rows"]] == [
        ("small", 0, 0.25), ("small", 64, 0.5), ("large", 0, 0.5), ("large", 64, 1.0)]
    assert {r["questions"] for r in table["rows"]} == {4}
    # The best fixed row is large at 64. The oracle answers q0 with small at 0, q1 with large at 0,
    # q3 with small at 64 and only q2 with large at 64: all right, at 3.5/24 dollars.
    oracle, (routed,) = table["oracle"], table["routed"]
    assert oracle["em"] == 1.0 and oracle["vs_best"]["cost"] == pytest.approx((0.001 + 0.003 + 0.006 + 0.002) / 0.024)
    assert oracle["vs_best"]["thinking"] == pytest.approx((50 + 50) / 4 / 50)
    assert (routed["mode"], routed["em"], routed["vs_best"]["em"]) == ("routed+cascade", 0.5, 0.5)
    assert routed["vs_best"]["cost"] == pytest.approx(0.009 / 0.024) and routed["vs_best"]["thinking"] == 0.25
    # At the best row's exact match, the oracle spends half its dollars and thinking: both
    # targets met, at the edge; the routed row keeps half the exact match, so neither is.
    assert oracle["targets"] == {"dollars": True, "thinking": True}
    assert routed["targets"] == {"dollars": False, "thinking": False}
    assert "| oracle (`cheapest right answer`) | – | 1.000 |" in text and "| met / met |" in text
    policies = {r["policy"]: r for r in table["policies"]["rows"]}
    assert table["policies"]["verdicts"] == {"easy": 2, "medium": 1, "hard": 1}
    # Without thinking the large model cannot do hard questions, so they stay small.
    assert (policies["fixed 0"]["em"], policies["fixed 0"]["thinking_tokens"]) == (0.5, 0)
    assert (policies["fixed 64"]["em"], policies["fixed 64"]["thinking_tokens"]) == (1.0, 50)
    by_difficulty = policies["0 / 0 / 64"]     # thinking for hard questions only
    assert (by_difficulty["em"], by_difficulty["thinking_tokens"], by_difficulty["large_share"]) == (0.75, 12.5, 0.5)
    assert by_difficulty["pareto"] and "| 0 / 0 / 64 | 0.750 | 12 |" in text
    assert (tmp_path / "out" / "budgets.png").stat().st_size > 0


def test_a_run_at_a_thinking_budget_is_allowed_it(engine, tmp_path):
    """Every request of a run at --thinking-budget 256 asks for 256 thinking tokens: its one
    tenant must allow them, or each is refused (as every answer of `make thinking-table` once was)."""
    from evals.runner import routed_modes
    from pipeline.answer import Refused
    config = config_for("gsm8k", [tmp_path / "gsm8k.jsonl"], thinking_budget=256)
    pipeline = pipeline_for(engine, config)
    for mode in [*MODES.values(), *routed_modes().values()]:
        terms = mode.terms(config)
        assert terms.client_thinking_cap == 256
        pipeline.check(terms, Query("2 + 2?", mode=mode.model, max_output_tokens=4, requested_thinking=256))
        with pytest.raises(Refused, match="at most 256 thinking tokens"):
            pipeline.check(terms, Query("2 + 2?", mode=mode.model, max_output_tokens=4, requested_thinking=257))
    assert MODES["large"].terms(config, arms=True).client_thinking_cap == 1024
    # A routed mode's closed-book margin reaches its tenant's policy; unset, the one margin serves both.
    policy = routed_modes(margin=0.2, closed_book_margin=0.05)["routed+cascade"].terms(config).policy
    assert (policy.arm_margin, policy.closed_book_margin) == (0.2, 0.05)
    assert routed_modes(margin=0.2)["routed"].terms(config).policy.closed_book_margin is None
    assert not routed_modes()["routed+cascade"].terms(config).policy.widen_from_cache
    assert routed_modes(widen_from_cache=True)["routed+cascade"].terms(config).policy.widen_from_cache


def test_a_run_folder_keeps_its_modes_settings(tmp_path):
    """A mode resumed at other settings (margin, threshold, widening) would mix two runs' answers
    under one name: refused, naming what differs; new modes join the folder's record."""
    from evals.runner import check_modes, routed_modes
    check_modes(tmp_path, [MODES["large"], routed_modes(threshold=0.35, margin=0.2)["routed+cascade"]])
    check_modes(tmp_path, [routed_modes(threshold=0.35, margin=0.2)["routed+cascade"], MODES["small"]])
    assert set(json.loads((tmp_path / "modes.json").read_text())) == {"large", "routed+cascade", "small"}
    with pytest.raises(RunError, match=r"mode routed\+cascade with other settings \(threshold: 0.35 there, 0.5 now; "
                                       r"widen_from_cache: False there, True now\)"):
        check_modes(tmp_path, [routed_modes(margin=0.2, widen_from_cache=True)["routed+cascade"]])


def _fake_runs(tmp_path, setting: str, scores: dict) -> list[Path]:
    """Run folders that differ only in `setting`; scores[(mode, value)]: F1 per question."""
    from evals.records import Call, Record
    folders = []
    for value in sorted({v for _, v in scores}):
        folder = tmp_path / f"{setting}{value}"
        open_run(folder, config_for("squad", [tmp_path / "squad.json"], **{setting: value}))
        log = RecordLog(folder / RECORDS_FILE)
        for mode in ("small", "large"):
            for i, f1 in enumerate(scores[(mode, value)]):
                call = Call(mode, value // 2, 0, 5, 0, 0.001, 0.0, 0.1, 1.0, 0.5, "stop", [])
                log.append(Record(mode, f"q{i}", "squad", f"q{i}", "", float(f1 == 1), f1, f1, f1 >= 0.5, False,
                                  2, value // 2, [0.5], [call]))
        log.close()
        folders.append(folder)
    return folders


def test_context_curve_chooses_each_models_budget(tmp_path):
    from evals.lab.contexts import read_chosen, write_context_curve
    # The small model drowns in passages, and 256 tokens trail 512 on every question: a gap with
    # no spread is real. The large model's 1,024 beats 512 on one question of four: a gap within
    # its standard error, so the cheaper 512.
    scores = {("small", 256): [0.5] * 4, ("small", 512): [1, 1, 1, 1], ("small", 1024): [1, 1, 1, 0],
              ("large", 256): [1, 0, 0, 0], ("large", 512): [1, 1, 1, 0], ("large", 1024): [1, 1, 1, 1]}
    text = write_context_curve(_fake_runs(tmp_path, "context_budget", scores), tmp_path / "out")
    curve = json.loads((tmp_path / "out" / "context.json").read_text())
    assert [(r["mode"], r["budget"], r["quality"], r["gap"]) for r in curve["rows"]] == [
        ("small", 256, 0.5, 0.5), ("small", 512, 1.0, 0.0), ("small", 1024, 0.75, 0.25),
        ("large", 256, 0.25, 0.75), ("large", 512, 0.75, 0.25), ("large", 1024, 1.0, 0.0)]
    assert [r["gap_se"] for r in curve["rows"]] == pytest.approx([0, 0, 0.25, 0.25, 0.25, 0])
    assert curve["chosen"] == {"small": 512, "large": 512} == read_chosen(tmp_path / "out")
    assert "| small (`tiny-1`) | 512 (chosen) | 1.000 | 0.000 ± 0.000 |" in text
    assert (tmp_path / "out" / "context.png").stat().st_size > 0
    with pytest.raises(RunError, match="not a context curve"):
        read_chosen(tmp_path / "out" / "context.md")


def test_labels_carry_arms_from_runs_at_other_thinking_budgets(tmp_path):
    from evals.lab.labels import provenance
    from evals.runner import CONFIG_FILE, RunError, read_config
    from router.data import read_labels
    scores = {("small", 0): [1, 0], ("large", 0): [1, 0], ("small", 256): [1, 1], ("large", 256): [0, 1]}
    base, think = _fake_runs(tmp_path, "thinking_budget", scores)
    assert write_labels(base, arm_runs=[think]) == 2
    labels = {l.id: l for l in read_labels(base)}
    assert {a: o.correct for a, o in labels["q1"].arms.items()} == {
        "small": False, "large": False, "small+think256": True, "large+think256": True}
    assert (labels["q0"].arms["large+think256"].correct, labels["q0"].arms["large"].output) == (False, 5)
    made = provenance([base])
    assert made["labels"][0]["by_source"] == {"generated": 2} and made["labels"][0]["run"]["thinking_budget"] == 0
    assert made["weights"]["small"] == {"source": "tiny-1", "gguf_sha256": None}
    # Labels of two pairs of models say nothing about one router's models.
    config = read_config(think)
    (think / CONFIG_FILE).write_bytes(msgspec.json.encode(msgspec.structs.replace(
        config, models=config.models | {"large": "other-2"})))
    with pytest.raises(RunError, match="different models"):
        provenance([base, think])


def test_proxy_scores_the_reference_as_transformers_does_and_labels_from_it(tmp_path, data, engine, embedder,
                                                                            monkeypatch):
    import torch
    import transformers

    from evals.lab.labels import LABELS_FILE
    from evals.lab.proxy import agreement, best_scores, distinct_answers, read_scores, score_run
    config = config_for("squad", files_for("squad", None, str(data)))
    folder = tmp_path / "run"
    dataset = run(folder, config, engine, embedder)
    collection = build_collection(folder, dataset, embedder, progress=False)
    try:
        pipeline = pipeline_for(engine, config)
        scores = score_run(folder, pipeline, config, dataset.examples, collection, progress=False)
        # Every distinct gold answer, once (s1 has two).
        assert sorted((s.id, s.model, s.answer) for s in scores) == sorted(
            (e.id, m, i) for e in dataset.examples for m in ("small", "large") for i in distinct_answers(e))
        assert len(distinct_answers(replace(dataset.examples[0], answers=["a", " a", "b", "a"]))) == 2
        # Each reference's mean log-probability after the served prompt, as transformers computes
        # it: the second answer scored after the first left the prompt in the prefix cache.
        example, model = next(e for e in dataset.examples if e.id == "s1"), "large"
        query = Query(example.question, mode=model, max_output_tokens=config.max_tokens, requested_thinking=0)
        plan = pipeline.plan(MODES[model].terms(config), query, collection, "x")
        hf = transformers.AutoModelForCausalLM.from_pretrained(engine.config.models[model].source, dtype=torch.float32)
        for answer in (0, 1):
            reference = engine.worker(model).tokenizer.encode(example.answers[answer])
            ids = torch.tensor([plan.prompt_ids + reference])
            logprobs = hf(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
            ours = next(s for s in scores if (s.id, s.model, s.answer) == (example.id, model, answer))
            assert ours.mean_logprob == pytest.approx(logprobs[-len(reference):].mean().item(), abs=2e-4)
            assert ours.retrieval_scores == [round(h.score, 4) for h in plan.context.hits]
        # Resumed: nothing is scored again.
        with monkeypatch.context() as m:
            m.setattr(engine, "score", lambda *a, **kw: pytest.fail("scored again"))
            assert len(score_run(folder, pipeline, config, dataset.examples, collection, progress=False)) == len(scores)
        # Killed mid-write: the torn line's score is made again, and the file stays readable.
        whole = (folder / "proxy.jsonl").read_bytes()
        (folder / "proxy.jsonl").write_bytes(whole[:-10])
        again = score_run(folder, pipeline, config, dataset.examples, collection, progress=False)
        assert [(s.id, s.model, s.answer) for s in read_scores(folder)] == [(s.id, s.model, s.answer) for s in scores]
        assert again[-1].mean_logprob == pytest.approx(scores[-1].mean_logprob, abs=1e-3)
    finally:
        collection.close()
    found = {a.model: a for a in agreement(folder, read_scores(folder), dataset.examples)}
    assert set(found) == {"small", "large"}
    for a in found.values():     # never worse than always saying "right" or always "wrong"
        assert a.questions == len(dataset.examples)
        assert a.agreement >= max(a.base_rate, 1 - a.base_rate)
    # Proxy labels for questions without generated answers: drop the records of two of them.
    log = RecordLog(folder / RECORDS_FILE)
    kept = [r for r in log.of_mode("small") if r.id not in {"s1", "s2"}]
    log.close()
    (folder / RECORDS_FILE).unlink()
    log = RecordLog(folder / RECORDS_FILE)
    for r in kept:
        log.append(r)
    log.close()
    thresholds = {m: a.threshold for m, a in found.items()}
    assert write_labels(folder, thresholds) == len(dataset.examples)
    rows = [json.loads(line) for line in (folder / LABELS_FILE).read_text().splitlines()]
    proxied = {r["id"]: r for r in rows if r["source"] == "proxy"}
    assert set(proxied) == {"s1", "s2"}
    by_score = best_scores(read_scores(folder), dataset.examples)      # the best answer's
    # The rest answered by the small model only: generated small, the large outcome from the proxy.
    small = {r.id: r for r in kept}
    mixed = {r["id"]: r for r in rows if r["source"] == "mixed"}
    assert set(mixed) == set(small) and len(mixed) == len(dataset.examples) - 2
    for qid, r in mixed.items():
        assert r["small_correct"] == small[qid].correct and r["confidence"] is not None
        assert r["large_correct"] == r["arms"]["large"]["correct"] == (by_score[qid, "large"] >= thresholds["large"])
    assert by_score["s1", "large"] == max(s.mean_logprob for s in read_scores(folder)
                                          if (s.id, s.model) == ("s1", "large"))
    # A question judged only when all its answers were scored: s1's second missing, no label.
    partial = [s for s in read_scores(folder) if (s.id, s.answer) != ("s1", 1)]
    assert ("s1", "large") not in best_scores(partial, dataset.examples) and ("s2", "large") in by_score
    for qid, r in proxied.items():
        assert r["small_correct"] == (by_score[qid, "small"] >= thresholds["small"])
        assert r["large_correct"] == (by_score[qid, "large"] >= thresholds["large"])
        assert r["confidence"] is None and r["retrieval_scores"]
    # The thresholds kept as a file outside the run (make router without generated answers).
    from evals.lab.proxy import PROXY_REPORT, read_thresholds
    from evals.runner import RunError
    (folder / PROXY_REPORT).write_bytes(msgspec.json.encode(list(found.values())))
    kept = tmp_path / "agreement.json"
    kept.write_bytes((folder / PROXY_REPORT).read_bytes())
    assert read_thresholds(kept) == read_thresholds(folder) == thresholds
    kept.write_bytes(msgspec.json.encode([found["small"]]))
    with pytest.raises(RunError, match="labels need small and large"):
        read_thresholds(kept)


def test_a_run_at_another_context_budget_adds_its_proxy_verdicts_as_arms(tmp_path, data, engine, embedder):
    # The large model scored alone at a smaller context budget: its verdicts become the arm
    # large@64 beside the labelled run's own small and large, with what its prompts cost.
    from evals.lab.labels import write_labels
    from evals.lab.proxy import best_scores, read_scores, score_run
    from router.data import read_labels
    files = files_for("squad", None, str(data))
    main, other = tmp_path / "main", tmp_path / "narrow"
    dataset = run(main, config_for("squad", files), engine, embedder)
    narrow = config_for("squad", files, context_budget=64)
    run(other, narrow, engine, embedder, modes=())
    collection = build_collection(other, dataset, embedder, progress=False)
    try:
        score_run(other, pipeline_for(engine, narrow), narrow, dataset.examples, collection, progress=False,
                  models=("large",))
    finally:
        collection.close()
    scores = read_scores(other)
    assert {s.model for s in scores} == {"large"}
    best = best_scores(scores, dataset.examples)
    threshold = float(np.median(list(best.values())))
    assert write_labels(main, {"small": 0.0, "large": threshold}, arm_runs=[other]) == len(dataset.examples)
    labels = read_labels(main)
    # A question the narrow budget cannot hold was refused there: no verdict, no arm.
    assert {l.id for l in labels if "large@64" in l.arms} == {qid for qid, _ in best}
    labels = [l for l in labels if "large@64" in l.arms]
    for label in labels:
        arm = label.arms["large@64"]
        assert arm.correct == (best[label.id, "large"] >= threshold) and arm.output is None
        assert arm.prompt == next(s.prompt for s in scores if s.id == label.id) <= label.arms["large"].prompt
    assert {l.arms["large@64"].correct for l in labels} == {True, False}
    assert any(l.arms["large@64"].prompt < l.arms["large"].prompt for l in labels)     # fewer passages


def test_heldout_scores_the_routers_arms_on_labels_it_never_saw(tmp_path):
    from evals.lab.heldout import write_heldout
    from router.model import train
    from tests.test_router import HashEmbedder
    from tests.test_router import write_labels as router_labels
    router, _ = train(router_labels(tmp_path / "train.jsonl"), HashEmbedder())
    folder = tmp_path / "test"
    open_run(folder, config_for("squad", [tmp_path / "squad.json"]))
    rows = [json.loads(line) for line in router_labels(tmp_path / "t.jsonl", n=30, seed=1).read_text().splitlines()]
    seen = rows[0] | {"id": "q0"}                  # a question the router trained on: left out
    (folder / "labels.jsonl").write_text("".join(json.dumps(r | {"id": f"t{i}"}) + "\n" for i, r in enumerate(rows))
                                         + json.dumps(seen) + "\n")
    report = write_heldout(folder, router, HashEmbedder())
    assert json.loads((folder / "heldout.json").read_text()) == report
    assert (report["questions"], report["left_out_as_trained_on"], report["sources"]) == (30, 1, {"generated": 30})
    # The arms' predictions separate easy (small right) from medium questions as the labels do.
    assert report["small_vs_large"]["router"]["apgr"] == pytest.approx(report["small_vs_large"]["oracle"]["apgr"])
    # A cascade pays the small call on top: dearer than the oracle router at 95% quality.
    two = report["small_vs_large"]
    assert two["oracle cascade"]["cost_at_95_vs_large"] > two["oracle"]["cost_at_95_vs_large"]
    assert (report["arms"]["small"]["quality"], report["arms"]["large"]["quality"]) == (0.3333, 0.6667)
    best, near = report["policies"]["0.0"], report["policies"]["0.05"]
    # Margin 0 buys the best predicted arm; within 0.05 of it, the cheapest arm that answers it:
    # small for easy questions, large for medium, thinking for hard, all right.
    assert best["quality"] == near["quality"] == 1.0 and near["quality_vs_large"] == 1.5
    assert near["arms"] == {"small": 10, "large": 10, "large+think256": 10}
    assert near["cost_vs_large"] < best["cost_vs_large"]
    assert report["cascade"] is None                   # one training label in the folder: no threshold to fit
    # With its training labels beside the held-out ones, the cascade's threshold is fitted on
    # those (95% of large-only quality there) and applied to these: the small model's sure
    # answers (the easy third) stand, and most wrong ones escalate, paying both calls.
    with (folder / "labels.jsonl").open("a") as f:
        f.write((tmp_path / "train.jsonl").read_text())
    cascade = write_heldout(folder, router, HashEmbedder())["cascade"]
    assert (cascade["trained_on"], cascade["questions"]) == (91, 30)        # q0 is in twice
    assert cascade["quality_vs_large"] >= 0.85 and 0.45 <= cascade["escalated"] <= 0.6667
    assert cascade["oracle_cascade_cost_at_95_vs_large"] <= cascade["cost_vs_large"] <= 1 / 3 + 0.6667


def test_heldout_states_the_thinking_targets_on_closed_book_labels(tmp_path):
    # Closed-book problems (nothing searched): easy ones any arm answers, medium ones need the
    # large model, hard ones thinking; large+think1024 also misses one easy problem in five
    # (it talks itself out of it), so it is the best arm but not the cheapest right one.
    from evals.lab.heldout import write_heldout
    from router.model import train
    from tests.test_router import HashEmbedder
    from tests.test_router import write_labels as router_labels

    def closed_book(path, **kw) -> list[dict]:
        rows = [json.loads(line) for line in router_labels(path, **kw).read_text().splitlines()]
        for i, r in enumerate(rows):
            r["retrieval_scores"] = []
            for name, arm in r["arms"].items():
                arm["thinking"] = int(name.partition("+think")[2] or 0)
            if i % 15 == 0:
                r["arms"]["large+think1024"] |= {"correct": False, "score": 0.0}
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows
    closed_book(tmp_path / "train.jsonl")
    router, _ = train(tmp_path / "train.jsonl", HashEmbedder())
    folder = tmp_path / "test"
    open_run(folder, config_for("gsm8k", [tmp_path / "gsm8k.jsonl"]))
    rows = closed_book(tmp_path / "t.jsonl", n=30, seed=1)
    (folder / "labels.jsonl").write_text("".join(json.dumps(r | {"id": f"t{i}"}) + "\n" for i, r in enumerate(rows)))
    thinking = write_heldout(folder, router, HashEmbedder())["thinking"]
    assert (thinking["questions"], thinking["best"]) == (30, "large+think1024")
    best = thinking["arms"]["large+think1024"]
    assert best["em"] == pytest.approx(28 / 30, abs=1e-4) and best["thinking_tokens"] == 1024
    # The oracle and the policy at margin 0.05 take the cheapest right arm per problem: small,
    # large, large+think256, a third each; every problem right, thinking only on hard ones.
    for row in (thinking["oracle"], thinking["policies"]["0.05"]):
        assert row["arms"] == {"small": 10, "large": 10, "large+think256": 10} and row["em"] == 1.0
        assert row["thinking_tokens"] == pytest.approx(256 / 3, abs=0.1)
        assert row["vs_best"]["thinking"] == pytest.approx(256 / 3 / 1024, abs=1e-3)
        assert row["targets"] == {"dollars": True, "thinking": True}
    assert best["targets"] == {"dollars": False, "thinking": False}     # itself: all of its own dollars
    # Labels without thinking counts (written before labels kept them): no such block.
    for r in rows:
        for arm in r["arms"].values():
            del arm["thinking"]
    (folder / "labels.jsonl").write_text("".join(json.dumps(r | {"id": f"t{i}"}) + "\n" for i, r in enumerate(rows)))
    assert write_heldout(folder, router, HashEmbedder())["thinking"] is None


def test_heldout_fits_a_narrow_arms_widening_on_training_labels_and_scores_it_on_the_rest(tmp_path):
    # large@256 is right where large is, and sure exactly when right: asking its unsure answers
    # again buys nothing here, so the cheapest threshold reaching 95% of large-only escalates none.
    from evals.lab.heldout import write_heldout
    from router.model import train
    from tests.test_router import HashEmbedder
    from tests.test_router import write_labels as router_labels
    router, _ = train(router_labels(tmp_path / "train.jsonl", narrow="large@256"), HashEmbedder())
    folder = tmp_path / "test"
    open_run(folder, config_for("squad", [tmp_path / "squad.json"]))
    rows = [json.loads(line) for line in
            router_labels(tmp_path / "t.jsonl", n=30, seed=1, narrow="large@256").read_text().splitlines()]
    (folder / "labels.jsonl").write_text("".join(json.dumps(r | {"id": f"t{i}"}) + "\n" for i, r in enumerate(rows))
                                         + (tmp_path / "train.jsonl").read_text())
    widen = write_heldout(folder, router, HashEmbedder())["widen"]["large@256"]
    assert (widen["trained_on"], widen["questions"]) == (90, 30)
    # (The threshold is the least training confidence: a held-out answer below it escalates.)
    assert widen["escalated"] <= 0.05 and widen["quality_vs_large"] == 1.0
    assert widen["cost_vs_large"] < 1.0


def test_a_smaller_thinking_budget_reuses_answers_that_never_reached_it(tmp_path, data, engine, embedder):
    """An answer that thought less than a smaller budget is the answer that budget gives (greedy
    decoding): `reuse` copies it, and a run that generates everything agrees on each copy."""
    from evals.runner import reusable
    gsm8k = files_for("gsm8k", None, str(data))
    run(tmp_path / "t8", config_for("gsm8k", gsm8k, thinking_budget=8), engine, embedder, modes=("large",))
    small = config_for("gsm8k", gsm8k, thinking_budget=3)
    reuse = reusable(tmp_path / "t8", small)
    wide = RecordLog(tmp_path / "t8" / RECORDS_FILE).records
    assert {k for k, r in wide.items() if r.tokens("thinking") < 3} == set(reuse) != set()
    assert len(reuse) < len(wide)           # the others reached 3 tokens and are generated again
    dataset = load_dataset(small)
    open_run(tmp_path / "t3", small)
    run_modes(tmp_path / "t3", small, dataset.examples, [MODES["large"]], pipeline_for(engine, small), None, 3,
              progress=False, reuse=reuse)
    fresh = run(tmp_path / "fresh", small, engine, embedder, modes=("large",)) and \
        RecordLog(tmp_path / "fresh" / RECORDS_FILE).records
    reused = RecordLog(tmp_path / "t3" / RECORDS_FILE).records
    assert set(reused) == set(fresh)
    for key, r in reused.items():
        assert r.copied_from == (str(tmp_path / "t8") if key in reuse else None)
        assert [x for c in r.calls for x in c.logprobs] == \
            pytest.approx([x for c in fresh[key].calls for x in c.logprobs], abs=1e-3)
        assert (r.answer, r.tokens("thinking"), r.tokens("output")) == \
            (fresh[key].answer, fresh[key].tokens("thinking"), fresh[key].tokens("output"))
    # Another draw of the same settings takes every answer to a question they share.
    two = msgspec.structs.replace(config_for("gsm8k", gsm8k, thinking_budget=8), n=2)
    assert set(reusable(tmp_path / "t8", two)) == set(wide)
    # Only a larger budget or another draw, at the same settings otherwise, serves.
    for other in (config_for("gsm8k", gsm8k, thinking_budget=9), config_for("gsm8k", gsm8k, thinking_budget=3, k=2)):
        with pytest.raises(RunError, match="the same settings, a smaller thinking budget"):
            reusable(tmp_path / "t8", other)


def test_the_server_and_eval_runs_load_the_same_weights_by_default(monkeypatch, tmp_path, data, capsys):
    """What evals measure is what is served: "auto" weights, gguf on the CPU and int8 on CUDA, chosen
    where the engine loads (a Ray replica's device, not its driver's) and recorded by an eval run."""
    import torch

    from engine.worker import resolve_quant
    from gateway.config import ServerConfig
    engine = ServerConfig().engine
    assert {m.quant for m in engine.models.values()} == {"auto"}
    files = files_for("gsm8k", None, str(data))
    for cuda, quant in ((False, "gguf"), (True, "int8")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert {m.quant for m in resolve_quant(engine).models.values()} == {quant}
        # An explicit device decides, whatever the host has; named weights stand.
        assert resolve_quant(msgspec.structs.replace(engine, device="cpu")).models["small"].quant == "gguf"
        assert resolve_quant(msgspec.structs.replace(engine, device="cuda:1")).models["small"].quant == "int8"
        named = msgspec.structs.replace(engine, models={**engine.models, "large": ModelEntry("x", quant="int4")})
        assert {n: m.quant for n, m in resolve_quant(named).models.items()} == {"small": quant, "large": "int4"}
        # An eval run resolves "auto" as the engine would and records it: a folder made on float32
        # names the difference before any model loads.
        open_run(tmp_path / quant, RunConfig("gsm8k", [str(f.resolve()) for f in files], 1, 0,
                                             {"small": "qwen2.5-coder-0.5b", "large": "qwen2.5-coder-1.5b"},
                                             default_prices()))
        assert evals_main(["run", "gsm8k", "--data", str(data), "-n", "1", "--out", str(tmp_path / quant)]) == 2
        assert f"quant: 'none' there, '{quant}' now" in capsys.readouterr().err
