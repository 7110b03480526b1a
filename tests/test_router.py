"""The router: features, difficulty classifier, confidence, policy and the cascade (tiny
models, synthetic labels, a hashing embedder: no real model runs here)."""
from __future__ import annotations

import hashlib
import json
import random
import re

import msgspec
import numpy as np
import pytest
from litestar.testing import TestClient

from gateway.config import RouterConfig
from gateway.http.app import create_app
from router.confidence import ConfidenceModel, quantiles
from router.data import RouterError, read_labels
from router.features import FEATURE_VERSION, RETRIEVED, feature_vector
from router.model import RouterModel, train
from tests.test_gateway_support import KEYS, auth, embedder, llm, make_gateway, parse_sse, tenant_toml, wait_ready  # noqa: F401


class HashEmbedder:
    """Deterministic unit vectors from the words, so similar questions land near each other."""
    dim = 16

    def encode(self, texts):
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().split():
                out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % self.dim] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-6)


# Per kind of question (easy, medium, hard): which arms answer it right. large+think1024 is
# right on all of them: nothing to learn, so a router leaves it out.
ARMS_RIGHT = {"small": (True, False, False), "large": (True, True, False),
              "large+think256": (True, False, True), "large+think1024": (True, True, True)}


def write_labels(path, n=90, seed=0, narrow: str | None = None):
    """Three kinds of questions whose difficulty follows their text and retrieval scores;
    the small model's confidence tracks whether it was right; arms as ARMS_RIGHT says.
    `narrow`: a narrow arm (large@256) too, right where large is, its answers as sure as they are right."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = i % 3
        question = ["what is the capital of france", "how many apples if 17 * 23 + 4 = ?",
                    "why did the empire fall and what followed"][kind] + f" v{i}"
        small, large = kind == 0, kind == 1 or (kind == 0)
        sure = -0.05 if small else -2.0
        lp = [sure + rng.uniform(-0.3, 0.0) for _ in range(rng.randint(3, 30))]
        m, lo, p10, p25, p50, length = quantiles(lp)
        confidence = {"mean": m, "min": lo, "p10": p10, "p25": p25, "p50": p50, "length": length}
        rows.append({"id": f"q{i}", "kind": "squad", "question": question, "small_correct": small,
                     "small_score": float(small),
                     "small_tokens": {"prompt": 9, "cached": 0, "output": 3, "thinking": 0},
                     "confidence": confidence,
                     "retrieval_scores": [[0.9, 0.3], [0.5, 0.45], [0.2, 0.19]][kind],
                     "large_correct": large, "large_score": float(large), "large_tokens": None,
                     "arms": {a: {"correct": right[kind], "score": float(right[kind]), "prompt": 300,
                                  "output": 20 + int(a.partition("+think")[2] or 0),
                                  "confidence": confidence if a == "small" else None}
                              for a, right in ARMS_RIGHT.items()}})
        if narrow:
            right = ARMS_RIGHT["large"][kind]
            lp = [(-0.05 if right else -2.0) + rng.uniform(-0.3, 0.0) for _ in range(rng.randint(3, 30))]
            rows[-1]["arms"][narrow] = {"correct": right, "score": float(right), "prompt": 250, "output": 20,
                                             "confidence": dict(zip(("mean", "min", "p10", "p25", "p50", "length"),
                                                                    quantiles(lp)))}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_kinds(folder) -> list:
    """write_labels' questions twice: answered from retrieved passages without the thinking
    arms (as SQuAD labels them), and closed-book with them, ten times the output (as GSM8K)."""
    rag = [json.loads(line) for line in write_labels(folder / "rag.jsonl").read_text().splitlines()]
    book = [r | {"id": f"c{i}", "retrieval_scores": [],
                 "arms": {a: o | {"output": 10 * o["output"]} for a, o in r["arms"].items()}}
            for i, r in enumerate(rag)]
    for r in rag:
        r["arms"] = {a: o for a, o in r["arms"].items() if "+think" not in a}
    for name, rows in (("rag", rag), ("book", book)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [folder / "rag.jsonl", folder / "book.jsonl"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = write_labels(tmp_path_factory.mktemp("run") / "labels.jsonl")
    model, report = train(path, HashEmbedder())
    return path, model, report



def test_holdout_leaves_the_same_questions_out_of_training(trained, tmp_path):
    from router.model import held_out
    path, full, _ = trained
    ids = {l.id for l in read_labels(path)}
    model, report = train(path, HashEmbedder(), holdout=0.25)
    out = {i for i in ids if held_out(i, 0.25)}
    assert 10 < len(out) < 35 and model.trained_on == ids - out == full.trained_on - out
    assert report.labels == len(ids) - len(out)
    with pytest.raises(RouterError, match="no labels left"):
        train(path, HashEmbedder(), holdout=1.0)
    from cli import main
    assert main(["train-router", str(path), "--holdout", "1.5", "--out", str(tmp_path / "r.joblib")]) == 2


def test_features_are_fixed_length():
    e = np.zeros(16, np.float32)
    assert feature_vector("what?", e, []).shape == feature_vector("why 12 + 3 = 15? " * 20, e, [0.9, 0.1, 0.05]).shape


def test_train_reports_held_out_accuracy_ece_and_confusion(trained):
    _, _, report = trained
    c = report.classifier
    assert c.counts == {"easy": 30, "medium": 30, "hard": 30}
    assert c.accuracy > 0.9 and 0 <= c.ece <= 1
    assert c.labels == ["easy", "medium", "hard"] and sum(map(sum, c.confusion)) == c.n_test
    assert report.confidence.brier < 0.1


class NoiseEmbedder:
    """Random unit vectors: an embedding that carries no signal."""
    dim = 64

    def encode(self, texts):
        out = np.random.default_rng(len(texts)).normal(size=(len(texts), self.dim)).astype(np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_the_embedding_is_used_only_when_it_predicts_better(tmp_path):
    path = write_labels(tmp_path / "labels.jsonl")
    # Noise for an embedding, the signal in the text and retrieval scores: leave it out.
    _, report = train(path, NoiseEmbedder())
    assert report.classifier.with_embedding is False
    assert report.classifier.cv_log_loss["without"] < report.classifier.cv_log_loss["with_embedding"]
    # Questions alike in every text and retrieval feature, told apart only by their words.
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    words = ["alpha beta gamma", "delta kappa omega", "sigma theta zeta"]
    for r in rows:
        r["question"], r["retrieval_scores"] = words[int(r["id"][1:]) % 3] + " what", [0.5, 0.4]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, report = train(path, HashEmbedder())
    assert report.classifier.with_embedding is True and report.classifier.accuracy > 0.9
    e = HashEmbedder().encode([words[2] + " what"])[0]
    assert model.classifier.predict(words[2] + " what", e, [0.5, 0.4]).label == "hard"


def test_classifier_predicts_calibrated_difficulty(trained):
    _, model, _ = trained
    e = HashEmbedder().encode(["why did the empire fall and what followed"])[0]
    d = model.classifier.predict("why did the empire fall and what followed", e, [0.2, 0.19])
    assert d.label == "hard" and 0.5 < d.probability <= 1


def test_save_load_and_feature_version(trained, tmp_path):
    _, model, _ = trained
    model.save(tmp_path / "r.joblib")
    assert RouterModel.load(tmp_path / "r.joblib").feature_version == FEATURE_VERSION
    RouterModel(model.classifier, model.confidence, feature_version=FEATURE_VERSION + 1).save(tmp_path / "old.joblib")
    with pytest.raises(RouterError, match="feature version"):
        RouterModel.load(tmp_path / "old.joblib")
    with pytest.raises(RouterError, match="cannot load"):
        RouterModel.load(tmp_path / "missing.joblib")


def test_confidence_calibrated_and_default_rule(trained):
    _, model, _ = trained
    sure, unsure = [-0.05] * 12, [-2.0] * 12
    hi, lo = model.confidence(sure), model.confidence(unsure)
    assert hi.calibrated and hi.value > 0.8 > 0.2 > lo.value
    default = ConfidenceModel()
    assert not default(sure).calibrated
    # Length alone does not move the default rule: a long sure answer is as sure as a short one.
    assert default([-0.05] * 3).value == pytest.approx(default([-0.05] * 300).value)
    assert default([]).value == 0.0


def test_the_checked_in_router_loads_and_says_what_made_it():
    """What `sluice serve --demo` serves mode=auto with: it loads with today's features, has
    arms over the engine's models, and its sidecar matches the file (`make router` remakes both)."""
    from router.model import TRAINED_ROUTER
    model = RouterModel.load(TRAINED_ROUTER)
    side = json.loads(TRAINED_ROUTER.with_suffix(".json").read_text())
    assert side["bytes"] == TRAINED_ROUTER.stat().st_size < 200_000
    assert side["feature_version"] == model.feature_version == FEATURE_VERSION
    assert [a.name for a in model.arms.arms] == [a["name"] for a in side["arms"]] and {"small", "large"} <= {
        a.model for a in model.arms.arms}
    assert side["command"].startswith("sluice train-router ") and side["rebuild"].startswith("make router")
    assert set(side["weights"]) == {"small", "large"} and all(w["gguf_sha256"] for w in side["weights"].values())
    assert sum(sum(run["by_source"].values()) for run in side["labels"]) == len(model.trained_on)


def test_bad_labels_are_refused(tmp_path):
    with pytest.raises(RouterError, match="no labels file"):
        read_labels(tmp_path)
    (tmp_path / "labels.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(RouterError, match="not a label"):
        read_labels(tmp_path)
    write_labels(tmp_path / "labels.jsonl", n=6)
    with pytest.raises(RouterError, match="need at least 8"):
        train(tmp_path, HashEmbedder())


def test_cli_train_router(trained, tmp_path, monkeypatch, capsys):
    import cli
    import retrieval
    path, _, _ = trained
    monkeypatch.setattr(retrieval, "Embedder", lambda device=None: HashEmbedder())
    (tmp_path / "context.json").write_text(json.dumps({"chosen": {"small": 512, "large": 2048}}))
    assert cli.main(["train-router", str(path), "--out", str(tmp_path / "r.joblib"),
                     "--context-curve", str(tmp_path / "context.json"), "--rebuild", "make router ROUTER_GEN=5"]) == 0
    assert json.loads(capsys.readouterr().out)["classifier"]["n_test"] > 0
    model = RouterModel.load(tmp_path / "r.joblib")
    assert {a.name: a.context_budget for a in model.arms.arms} == {"small": 512, "large": 2048, "large+think256": 2048}
    # The sidecar: how to make it again, and what it holds.
    side = json.loads((tmp_path / "r.json").read_text())
    assert side["command"] == (f"sluice train-router {path} --context-curve {tmp_path / 'context.json'} "
                               f"--out {tmp_path / 'r.joblib'}")
    assert side["bytes"] == (tmp_path / "r.joblib").stat().st_size and side["context_budgets"]["small"] == 512
    assert side["rebuild"] == "make router ROUTER_GEN=5"
    assert side["report"]["arms"]["left_out"] and [a["name"] for a in side["arms"]][0] == "small"
    assert cli.main(["train-router", str(tmp_path / "nothing")]) == 2


# ------------------------------------------------------------------ policy

def _policy(**kw):
    from router.policy import Policy
    base = dict(default_model="small", allowed=("small", "large"),
                thinking={"easy": 0, "medium": 64, "hard": 256}, escalation_threshold=0.5)
    return Policy(**{**base, **kw})


def test_policy_maps_difficulty_and_honours_overrides():
    import time

    from router import policy
    from router.classifier import Difficulty
    route = lambda p, predict: policy.route(p, "small", "large", predict)
    hard = lambda: Difficulty("hard", 0.9)
    r = route(_policy(), hard)
    assert (r.model, r.difficulty, r.thinking_tokens, r.escalate_to) == ("large", "hard", 256, None)
    assert "classifier: hard (p=0.90)" in r.reason and r.source == "classifier"
    easy = route(_policy(), lambda: Difficulty("easy", 0.8))
    assert (easy.model, easy.thinking_tokens, easy.escalate_to) == ("small", 0, "large")
    medium = route(_policy(thinking={"easy": 0, "medium": 0, "hard": 0}), lambda: Difficulty("medium", 0.6))
    assert (medium.model, medium.escalate_to) == ("large", None)
    for unthinking in (_policy(thinking={"easy": 0, "medium": 64, "hard": 0}), _policy(router_thinking_cap=0)):
        r = route(unthinking, hard)     # neither model answers hard questions without thinking
        assert (r.model, r.thinking_tokens, r.escalate_to) == ("small", 0, "large")
        assert "no thinking for hard questions" in r.reason
    never = route(_policy(force="never_large"), hard)
    assert (never.model, never.escalate_to) == ("small", None) and "not allowed" in never.reason
    forced = route(_policy(force="always_large"), None)
    assert (forced.model, forced.source) == ("large", "policy")
    assert route(_policy(router_thinking_cap=100), hard).thinking_tokens == 100
    assert route(_policy(escalation=False), lambda: Difficulty("easy", 0.8)).escalate_to is None
    off = route(_policy(classifier=False), hard)
    assert off.model == "small" and off.reason == "classifier off for this tenant; tenant default"
    assert off.source == "fallback"

    def broken():
        raise RuntimeError("boom")
    assert route(_policy(), broken).reason == "classifier failed (RuntimeError: boom); tenant default"
    slow = route(_policy(classifier_timeout_s=0.01), lambda: time.sleep(0.3) or Difficulty("hard", 1.0))
    assert slow.model == "small" and slow.reason == "classifier slower than 10 ms; tenant default"
    assert route(_policy(), None).reason == "no classifier trained; tenant default"


def test_arms_predict_per_arm_correctness_and_leave_out_what_cannot_be_learnt(trained):
    _, model, report = trained
    arms = model.arms
    assert [a.name for a in arms.arms] == ["small", "large", "large+think256"]
    assert "90 right" in report.arms.left_out["large+think1024 (retrieved)"]
    think = report.arms.arms["large+think256"]["retrieved"]
    assert (think["labels"], think["prompt_tokens"], think["output_tokens"]) == (90, 300.0, 276.0)
    for kind, question in enumerate(["what is the capital of france v0", "how many apples if 17 * 23 + 4 = ? v1",
                                     "why did the empire fall and what followed v2"]):
        p = arms.predict(question, HashEmbedder().encode([question])[0], [[0.9, 0.3], [0.5, 0.45], [0.2, 0.19]][kind])
        for name, right in ARMS_RIGHT.items():
            if name in p:
                assert (p[name] > 0.5) == right[kind], (question, name, p)
    # Serving's folded linear form is sklearn's predict_proba, for every arm at once.
    rows = np.random.default_rng(0).standard_normal((20, arms.folded[0].shape[1])).astype(np.float32)
    rows[:, RETRIEVED] = 1.0            # questions answered from retrieved passages, as every label was
    for name, p in arms.predict_rows(rows).items():
        np.testing.assert_allclose(p, arms.models[name, True].predict_proba(rows)[:, 1], atol=1e-6)   # sklearn: float32
    budgets = arms.with_budgets({"small": 512})
    assert [a.context_budget for a in budgets.arms] == [512, None, None]


def test_arms_are_offered_and_priced_per_kind_of_question(tmp_path):
    """Thinking arms labelled on closed-book questions only (as GSM8K labels them): offered
    for those and not for questions answered from retrieved passages, where their classifier
    never saw a label; every arm is priced by its labels of the question's kind."""
    from router.policy import route_arms
    model, report = train(write_kinds(tmp_path), HashEmbedder())
    arms = model.arms
    assert {a: set(t) for a, t in arms.tokens.items()} == {"small": {True, False}, "large": {True, False},
                                                           "large+think256": {False}}
    assert arms.output_tokens("large", True) == 20 and arms.output_tokens("large", False) == 200
    assert report.arms.arms["large"]["closed_book"]["labels"] == report.arms.arms["large"]["retrieved"]["labels"] == 90
    assert set(arms.models) == {("small", True), ("small", False), ("large", True), ("large", False),
                                ("large+think256", False)}
    question = "why did the empire fall and what followed v2"
    e = HashEmbedder().encode([question])[0]
    assert set(arms.predict(question, e, [])) == {"small", "large", "large+think256"}
    assert set(arms.predict(question, e, [0.2, 0.19])) == {"small", "large"}
    rows = np.stack([feature_vector(question, e, s, arms.with_embedding) for s in ([], [0.2, 0.19])])
    assert np.isnan(arms.predict_rows(rows)["large+think256"]).tolist() == [False, True]
    # A hard question: thinking is the arm that answers it, where it is offered.
    policy = _policy(thinking={"easy": 0, "medium": 0, "hard": 256}, arm_margin=0.05)
    pick = lambda scores: route_arms(policy, arms.arms, "small", "large", lambda: arms.predict(question, e, scores),
                                     lambda arm: 1.0 if arm.model == "large" else 0.3).arm
    assert pick([]) == "large+think256" and pick([0.2, 0.19]) in ("small", "large")
    with pytest.raises(RouterError, match="more than one"):
        train([tmp_path / "rag.jsonl", tmp_path / "rag.jsonl"], HashEmbedder())


def test_an_arm_named_with_a_context_budget_keeps_it_and_borrows_its_models_output():
    from router.arms import arm_name, arm_tokens, parse_arm
    from router.data import ArmOutcome, RouterError
    assert ((arm_name("large", 0, 256), arm_name("large", 1024), arm_name("small"))
            == ("large@256", "large+think1024", "small"))
    arm = parse_arm("large+think256@384", 512)
    assert (arm.model, arm.thinking, arm.context_budget) == ("large", 256, 384)
    assert parse_arm("large@256", 512).context_budget == 256 and parse_arm("large", 512).context_budget == 512
    with pytest.raises(RouterError, match="expected MODEL"):
        parse_arm("large@many")
    # A proxy-labelled arm knows its prompts but generated nothing: the same model's output stands in.
    tokens = arm_tokens({"large": [ArmOutcome(True, 1.0, 500, 20), ArmOutcome(False, 0.0, 480, 30)],
                         "large@256": [ArmOutcome(True, 1.0, 230), ArmOutcome(True, 1.0, 250)],
                         "small": [ArmOutcome(True, 1.0)]})
    assert tokens == {"large": (490.0, 25.0), "large@256": (240.0, 25.0), "small": (0.0, 48.0)}


def test_route_arms_takes_the_cheapest_arm_near_the_best_within_the_tenants_caps():
    import time

    from router.arms import parse_arm
    from router.policy import route_arms
    arms = tuple(parse_arm(n, 256 if n == "small" else None) for n in ("small", "large", "large+think256"))
    price = {"small": 1.0, "large": 3.0, "large+think256": 6.0}
    probs = {"small": 0.60, "large": 0.62, "large+think256": 0.70}
    route = lambda p, predict=lambda: probs: route_arms(p, arms, "small", "large", predict, lambda a: price[a.name])
    r = route(_policy(arm_margin=0.1))
    assert (r.arm, r.model, r.thinking_tokens, r.context_budget, r.escalate_to) == ("small", "small", 0, 256, "large")
    assert (r.source, r.confidence) == ("arms", 0.60)
    assert r.reason.startswith("arms: small (P(right) 0.60, $1.000000) is the cheapest within 0.10 of the best, "
                               "large+think256 (0.70)")
    best = route(_policy(arm_margin=0.0))
    assert (best.arm, best.model, best.thinking_tokens, best.escalate_to) == ("large+think256", "large", 256, None)
    assert best.reason.endswith("is the best")
    # The tenant's thinking budgets cap the arms it may get: without 256 thinking tokens, large is the best left.
    capped = route(_policy(arm_margin=0.0, thinking={"easy": 0, "medium": 0, "hard": 64}))
    assert capped.arm == "large" and capped.reason.endswith("of 2 arms this tenant allows")
    # An arm with no classifier for this kind of question is not offered, not refused by the tenant.
    other_kind = route(_policy(arm_margin=0.0), predict=lambda: {a: p for a, p in probs.items() if a != "small"})
    assert other_kind.arm == "large+think256" and other_kind.reason.endswith("is the best")
    assert route(_policy(arm_margin=0.0, router_thinking_cap=0)).arm == "large"
    assert route(_policy(arm_margin=0.0, force="never_large")).arm == "small"
    assert route(_policy(arm_margin=1.0, force="always_large")).arm == "large"
    assert route(_policy(arm_margin=0.0, allowed=("small",))).arm == "small"
    # A closed-book question (nothing searched) goes by the tenant's closed-book margin, where it has one.
    book = lambda p: route_arms(p, arms, "small", "large", lambda: probs, lambda a: price[a.name], retrieved=False)
    assert book(_policy(arm_margin=0.1)).arm == "small"                       # none: arm_margin
    thinks = book(_policy(arm_margin=0.1, closed_book_margin=0.0))
    assert thinks.arm == "large+think256" and thinks.reason.endswith("is the best")
    assert "within 0.09 of the best" in book(_policy(arm_margin=0.0, closed_book_margin=0.09)).reason
    assert route(_policy(arm_margin=0.1, closed_book_margin=0.0)).arm == "small"    # retrieved: arm_margin

    def broken():
        raise RuntimeError("boom")
    fallback = route(_policy(), broken)
    assert (fallback.arm, fallback.model, fallback.source) == (None, "small", "fallback")
    assert fallback.reason == "classifier failed (RuntimeError: boom); tenant default"
    slow = route(_policy(classifier_timeout_s=0.01), lambda: time.sleep(0.3) or probs)
    assert slow.arm is None and slow.reason == "classifier slower than 10 ms; tenant default"
    assert route(_policy(classifier=False)).reason == "classifier off for this tenant; tenant default"


# ------------------------------------------------------------------ gateway: the cascade under mode=auto



def _client(tmp_path, llm, embedder, threshold: float, router=RouterConfig(), extra: str = "", **tenant):
    tenants = {"alpha": f"escalation_threshold = {threshold}\n" + tenant_toml(KEYS["alpha"], **tenant) + extra}
    gw = make_gateway(tmp_path, llm, embedder, tenants, router=router)
    return TestClient(create_app(gw)), gw


def _ask(c, **body):
    r = c.post("/v1/ask", json={"question": "t5 t6 t7", "max_output_tokens": 4, **body}, headers=auth())
    assert r.status_code == 200, r.text
    return r.json()


def test_low_confidence_escalates_to_the_large_model_and_bills_both(tmp_path, llm, embedder):
    client, gw = _client(tmp_path, llm, embedder, threshold=1.0)
    with client as c:
        wait_ready(c)
        large = _ask(c, mode="large")
        body = _ask(c)
    assert (body["model"], body["escalated"]) == ("large", True)
    assert body["answer"] == large["answer"]             # greedy: the large model's own answer
    assert 0 < body["confidence"] < 1
    assert "uncalibrated" in body["route_reason"] and "escalated to large" in body["route_reason"]
    assert body["usage"]["completion"] == 8              # both calls' tokens are counted and billed
    assert body["cost"] > large["cost"]
    row = gw.ledger.rows()[-1]
    assert (row.model, row.models, row.escalated, row.completion_tokens) == ("large", "small,large", True, 8)


def test_confident_answers_stand_and_stream_after_the_verdict(tmp_path, llm, embedder):
    client, _ = _client(tmp_path, llm, embedder, threshold=1e-9)
    with client as c:
        wait_ready(c)
        small = _ask(c, mode="small")
        body = _ask(c)
        r = c.post("/v1/ask", json={"question": "t5 t6 t7", "max_output_tokens": 4, "stream": True}, headers=auth())
    assert (body["model"], body["escalated"], body["answer"]) == ("small", False, small["answer"])
    assert body["confidence"] is not None and "kept" in body["route_reason"]
    frames = parse_sse(r.text)
    assert frames[0][0] == "meta" and frames[-1][0] == "done"
    meta = msgspec.json.decode(frames[0][1])
    assert meta["route"]["confidence"] is not None and meta["route"]["escalated"] is False
    assert "".join(msgspec.json.decode(d)["text"] for e, d in frames if e == "token") == small["answer"]


def test_escalation_offers_the_small_answer_as_a_speculative_draft(tmp_path, tmp_path_factory, embedder):
    from engine.config import SpecConfig
    from engine.llm_engine import LLMEngine
    from tests.test_gateway_support import engine_config
    config = msgspec.structs.replace(engine_config(tmp_path_factory), speculative=SpecConfig("large", "small"))
    engine = LLMEngine(config, progress=False)
    drafts = []
    add = engine.add_request
    engine.add_request = lambda *a, **kw: drafts.append(a[6] if len(a) > 6 else kw.get("draft")) or add(*a, **kw)
    client, _ = _client(tmp_path, engine, embedder, threshold=1.0)
    with client as c:
        wait_ready(c)
        body = _ask(c)
        plain = _ask(c, mode="large")
    assert body["escalated"] and body["answer"] == plain["answer"]
    assert drafts[0] is None and len(drafts[1]) == 4      # the small call, then the large one with its draft


def test_a_broken_router_falls_back_to_the_tenant_default(tmp_path, llm, embedder):
    (tmp_path / "broken.joblib").write_bytes(b"not a router")
    client, _ = _client(tmp_path, llm, embedder, threshold=1e-9, router=RouterConfig(str(tmp_path / "broken.joblib")))
    with client as c:
        wait_ready(c)
        body = _ask(c)
        metrics = c.get("/metrics").text
    assert body["model"] == "small" and body["route_reason"].startswith("classifier failed (RouterError:")
    assert 'sluice_route_decisions_total{tenant="alpha",model="small",difficulty="none",source="fallback"} 1' in metrics
    assert "tenant default" in body["route_reason"]


def test_a_trained_router_routes_by_difficulty(tmp_path, llm, embedder):
    path = write_labels(tmp_path / "labels.jsonl")
    model, _ = train(path, embedder)
    model.arms = None             # a router without arms routes by the difficulty classifier
    model.save(tmp_path / "router.joblib")
    client, _ = _client(tmp_path, llm, embedder, threshold=1e-9, router=RouterConfig(str(tmp_path / "router.joblib")),
                        extra="[router]\nclassifier_timeout_ms = 2000\n")
    with client as c:
        wait_ready(c)
        hard = _ask(c, question="why did the empire fall and what followed")
        easy = _ask(c, question="what is the capital of france")
    # This tenant gives hard questions no thinking, so the large model would not do better.
    assert (hard["model"], hard["difficulty"], hard["escalated"]) == ("small", "hard", False)
    assert "no thinking for hard questions" in hard["route_reason"]
    assert (easy["model"], easy["difficulty"]) == ("small", "easy") and "kept" in easy["route_reason"]


def test_auto_answers_through_the_arms_with_the_arm_in_the_response_and_the_ledger(tmp_path, llm, embedder):
    from tests.test_gateway_support import DOCS
    path = write_labels(tmp_path / "labels.jsonl")
    model, _ = train(path, embedder)
    assert model.arms is not None
    model.arms = model.arms.with_budgets({"small": 60})      # the small model reads fewer passages
    model.save(tmp_path / "router.joblib")
    client, gw = _client(tmp_path, llm, embedder, threshold=1e-9, router=RouterConfig(str(tmp_path / "router.joblib")),
                         extra="[router]\nclassifier_timeout_ms = 2000\narm_margin = 0.1\n")
    with client as c:
        wait_ready(c)
        assert c.post("/v1/collections/kb/documents", json=DOCS, headers=auth()).status_code in (200, 201)
        medium = _ask(c, question="how many apples if 17 * 23 + 4 = ?", collection="kb")
        easy = _ask(c, question="what is the capital of france", collection="kb")
        # Every label was of a question answered from retrieved passages: a closed-book one
        # has no arm to go by, and gets the tenant's default.
        book = _ask(c, question="how many apples if 17 * 23 + 4 = ?")
        r = c.post("/v1/ask", json={"question": "what is the capital of france", "collection": "kb", "stream": True,
                                    "max_output_tokens": 4}, headers=auth())
    assert (medium["arm"], medium["model"]) == ("large", "large")
    assert book["arm"] is None and "no arm was trained on this kind of question" in book["route_reason"]
    assert medium["route_reason"].startswith("arms: large (P(right) ") and medium["confidence"] > 0.5
    assert (easy["arm"], easy["model"]) == ("small", "small") and easy["route_reason"].startswith("arms: small")
    # The small arm's own context budget: the same search, trimmed to 60 tokens, not the tenant's 400.
    assert "context trimmed to the arm's 60 tokens" in easy["route_reason"]
    assert easy["trimmed"]["budget"] == 60 and easy["trimmed"]["tokens"] <= 60
    meta = msgspec.json.decode(parse_sse(r.text)[0][1])
    assert meta["route"]["arm"] == "small"
    rows = gw.ledger.rows()
    assert [row.arm for row in rows[-4:]] == ["large", "small", None, "small"]
    assert rows[-4].route_reason == medium["route_reason"]


def test_a_narrow_arm_gets_a_confidence_model_of_its_own_and_widens_when_unsure(tmp_path):
    from router.policy import route_arms
    model, report = train(write_labels(tmp_path / "labels.jsonl", narrow="large@256"), HashEmbedder())
    assert "large@256" in [a.name for a in model.arms.arms] and set(model.narrow) == {"large@256"}
    assert report.narrow["large@256"].n_test > 0 and report.narrow["large@256"].brier < 0.1
    judge = model.narrow["large@256"]
    assert judge([-2.0] * 10).value < 0.5 < judge([-0.05] * 10).value
    model.save(tmp_path / "r.joblib")
    assert set(RouterModel.load(tmp_path / "r.joblib").narrow) == {"large@256"}
    # Routed to the narrow arm, its answer escalates to the same model (with the whole context,
    # pipeline.Answer); without widening, or without escalation, it stands.
    probs = {"small": 0.2, "large@256": 0.7, "large": 0.72}
    price = {"small": 1.0, "large@256": 2.0, "large": 3.0}
    route = lambda **kw: route_arms(_policy(**kw), model.arms.arms, "small", "large", lambda: probs,
                                    lambda a: price[a.name], frozenset(model.narrow))
    assert (route().arm, route().escalate_to) == ("large@256", "large")
    assert route(widen=False).escalate_to is None and route(escalation=False).escalate_to is None
    assert route(arm_margin=0.0).escalate_to is None            # the large arm: nothing wider to ask
    old = train(write_labels(tmp_path / "plain.jsonl"), HashEmbedder())[0]
    assert old.narrow == {}


def test_a_narrow_arm_is_offered_at_the_budget_its_labels_were_made_at(tmp_path):
    model, _ = train(write_labels(tmp_path / "labels.jsonl", narrow="large@192"), HashEmbedder())
    arms = {a.name: a for a in model.arms.arms}
    assert arms["large@192"].context_budget == 192 and "large@256" not in arms and set(model.narrow) == {"large@192"}
    # Cheapest first, the narrow arm after the small model's.
    order = ["small", "large@192", "large", "large+think256", "large+think1024"]
    assert list(arms) == [n for n in order if n in arms] and len(arms) >= 3


def test_a_narrow_arm_labelled_on_selected_passages_is_offered_only_to_tenants_that_select(tmp_path, llm):
    """At 192 tokens selected clauses hold the answer far more often than whole chunks, so a
    narrow arm's chance of being right does not carry from one to the other."""
    from pipeline import Pipeline, Query, Terms
    from router.policy import Policy
    from tests.test_gateway_support import PRICES
    trained, _ = train(write_labels(tmp_path / "labels.jsonl", narrow="large@192"), HashEmbedder(), selection=True)
    trained.save(tmp_path / "r.joblib")
    model = RouterModel.load(tmp_path / "r.joblib")
    assert model.selection is True
    probs = {a.name: 0.1 if a.name == "small" else 0.9 for a in model.arms.arms}
    dollars = {name: n for n, name in enumerate(probs)}      # cheapest first, as offered
    policy = Policy("small", ("small", "large"), {"easy": 0, "medium": 0, "hard": 0}, 0.5, arm_margin=0.1)
    unrecorded = RouterModel.load(tmp_path / "r.joblib")
    unrecorded.selection = None               # an older router, which offers every arm it has
    for router, selection, arm in ((model, True, "large@192"), (model, False, "large"),
                                   (unrecorded, False, "large@192")):
        pipeline = Pipeline(llm, PRICES, router=router, pair=("small", "large"))
        r = pipeline.route(Terms("acme", policy, 512, 32, b"salt", selection), Query("q"), lambda: probs,
                           lambda a: dollars[a.name])
        assert r.arm == arm
        assert ("no narrow arm: its labels read selected passages, this tenant's are whole" in r.reason) == \
            (arm == "large" and not selection)

def test_an_unsure_narrow_answer_is_asked_again_with_the_whole_context(tmp_path, llm, embedder):
    from dataclasses import replace

    from tests.test_gateway_support import DOCS
    model, _ = train(write_labels(tmp_path / "labels.jsonl", narrow="large@256"), embedder)
    # 75 tokens hold one passage of this small corpus (the best, Paris), not two; the plain
    # large arm reads 300 (its context curve's), which holds all three, as the tenant's 400 does.
    budgets = {"large@256": 75, "large": 300}
    model.arms = replace(model.arms, arms=tuple(replace(a, context_budget=budgets.get(a.name, a.context_budget))
                                                for a in model.arms.arms))
    model.save(tmp_path / "router.joblib")
    bodies, rows, widened = {}, {}, {}
    for widen, cached in ((True, True), (False, True), (True, False)):
        # Always large, the cheapest arm: large@256; threshold 1: every answer judged unsure.
        # Whole passages, so that 75 tokens hold exactly one of them.
        client, gw = _client(tmp_path / f"w{widen}{cached}", llm, embedder, threshold=1.0, selection=False,
                             router=RouterConfig(str(tmp_path / "router.joblib")),
                             extra=f'[router]\nclassifier_timeout_ms = 2000\narm_margin = 1.0\n'
                                   f'models = "always_large"\n'
                                   f"widen = {str(widen).lower()}\nwiden_from_cache = {str(cached).lower()}\n")
        with client as c:
            wait_ready(c)
            assert c.post("/v1/collections/kb/documents", json=DOCS, headers=auth()).status_code in (200, 201)
            large = _ask(c, question="what is the capital of france", collection="kb", mode="large")
            bodies[widen, cached] = _ask(c, question="what is the capital of france", collection="kb")
            rows[widen, cached] = gw.ledger.rows()[-1]
            counted = re.search(r"^sluice_widened_total (\S+)$", c.get("/metrics").text, re.M)
            widened[widen, cached] = float(counted.group(1) if counted else 0)
    wide, narrow, canonical = bodies[True, True], bodies[False, True], bodies[True, False]
    assert wide["arm"] == narrow["arm"] == "large@256" and wide["escalated"] and not narrow["escalated"]
    assert "context trimmed to the arm's 75 tokens" in wide["route_reason"]
    assert [c["doc_id"] for c in narrow["citations"]] == ["paris"] and narrow["trimmed"]["budget"] == 75
    tokens = wide["trimmed"]["tokens"]
    assert 75 < tokens < 300 and f"escalated to large with a {tokens}-token context" in wide["route_reason"]
    # The escalation reads the large arm's context, every passage here as large-only's, but led
    # by the one the narrow answer read, so its prompt extends the narrow one's and the prefix
    # cache serves that part (large-only's order, by document, starts with Berlin).
    assert [c["doc_id"] for c in large["citations"]] == ["berlin", "paris", "rome"]
    assert [c["doc_id"] for c in wide["citations"]] == ["paris", "berlin", "rome"]
    assert wide["trimmed"]["kept"] == large["trimmed"]["kept"] == 3 and wide["trimmed"]["budget"] == 300
    # widen_from_cache = false: the plain arm's context and order, large-only's prompt and answer,
    # paid on top of the narrow call.
    assert canonical["citations"] == large["citations"] and canonical["answer"] == large["answer"]
    assert canonical["trimmed"] == {**large["trimmed"], "budget": 300} and canonical["cost"] > large["cost"]
    assert ([rows[k].models for k in ((True, True), (False, True), (True, False))]
            == ["large,large", "large", "large,large"])
    assert widened == {(True, True): 1.0, (False, True): 0.0, (True, False): 1.0}


def test_the_early_verdict_reads_the_shortest_prefix_that_judges_as_well(tmp_path):
    """Answers whose first tokens already show doubt get an early model at the shortest prefix;
    answers that only falter late get none."""
    from router.confidence import EARLY_TOKENS, train_early
    from router.data import Confidence, Label
    rng = random.Random(0)

    def label(i: int, late: bool) -> Label:
        right = i % 2 == 0
        sure = lambda: -0.02 + rng.uniform(-0.02, 0.0)
        unsure = lambda: -2.0 + rng.uniform(-0.5, 0.0)
        head = [sure() if (right or late) else unsure() for _ in range(40)]
        tail = [sure() if right else unsure() for _ in range(20)]
        lp = head + tail
        conf = lambda xs: Confidence(*quantiles(xs))
        return Label(f"q{i}", "q", right, conf(lp), [], early={str(k): conf(lp[:k]) for k in EARLY_TOKENS})

    early, report = train_early([label(i, late=False) for i in range(80)])
    assert early is not None and early.tokens == EARLY_TOKENS[0] == report.chosen
    assert early.confidence([-2.0] * 8).value < 0.5 < early.confidence([-0.02] * 8).value
    late, report = train_early([label(i, late=True) for i in range(80)])
    assert late is None and report.chosen is None
    prefix, whole = report.brier[EARLY_TOKENS[-1]]
    assert prefix > whole * 1.05
