"""The answer pipeline: one path for the gateway and evals. An eval run and /v1/ask give the
same answers, tokens and dollars for the same questions; a client's thinking budget of 0 is
its own, distinct from not giving one."""
from __future__ import annotations

import re

import msgspec
import pytest

from evals.datasets import Example
from evals.records import RecordLog
from evals.runner import RECORDS_FILE, Mode, RunConfig, open_run, pipeline_for, run_modes
from gateway.config import RouterConfig
from gateway.http.app import create_app
from pipeline import Pipeline, Query, Refused, Terms
from retrieval import CollectionStore, Document
from router.policy import Policy
from tests.test_gateway_support import DOCS, KEYS, PRICES, auth, embedder, llm, make_gateway, tenant_toml, wait_ready  # noqa: F401

QUESTIONS = [("q-paris", "What is the capital of France?", True), ("q-rome", "Where is the Colosseum?", True),
             ("q-bare", "t5 t6 t7 t8", False)]


def test_an_eval_run_and_the_gateway_answer_and_bill_alike(tmp_path, llm, embedder):
    from litestar.testing import TestClient
    # Threshold 1: every first answer escalates, so the cascade's two calls are compared too.
    # Each mode through a tenant with a salt of its own, as an eval gives each mode a prefix
    # cache of its own (and no other test's cached blocks serve these prompts).
    tenant = {"auto": "alpha", "large": "beta"}
    tomls = {name: "escalation_threshold = 1.0\n" + tenant_toml(KEYS[name], salt=f"salt-pipeline-test-{mode}")
             + "[router]\nclassifier = false\n" for mode, name in tenant.items()}
    gw = make_gateway(tmp_path / "gw", llm, embedder, tomls, router=RouterConfig())
    served = {}
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        for name in tenant.values():
            assert c.post("/v1/collections/kb/documents", json=DOCS, headers=auth(name)).status_code in (200, 201)
        for mode in ("auto", "large"):          # in the eval's order: a mode over every question
            for qid, question, retrieve in QUESTIONS:
                r = c.post("/v1/ask", json={"question": question, "mode": mode,
                                            **({"collection": "kb"} if retrieve else {})}, headers=auth(tenant[mode]))
                assert r.status_code == 200, r.text
                served[mode, qid] = r.json()
    rows = {row.request_id: row for row in gw.ledger.rows()}

    spec = msgspec.json.decode(msgspec.json.encode(gw.tenants.get("alpha").spec))
    config = RunConfig("jsonl", [], None, 0, {"small": "tiny-1", "large": "tiny-2"}, PRICES,
                       context_budget=spec["context_budget"], max_tokens=spec["output_budget"])
    open_run(tmp_path / "run", config)
    collection = CollectionStore(tmp_path / "collections", embedder).collection("evals", "corpus")
    collection.ingest([Document(d["id"], d["text"], d["title"]) for d in DOCS["documents"]])
    examples = [Example(qid, "qa", question, ["x"], retrieve) for qid, question, retrieve in QUESTIONS]
    modes = [Mode("cascade", "auto", classifier=False, escalation=True, threshold=1.0), Mode("large", "large")]
    try:
        # One question at a time, as the test client asked them: the prefix cache then holds
        # the same blocks on both sides when each call arrives.
        run_modes(tmp_path / "run", config, examples, modes, pipeline_for(llm, config), collection, 1, progress=False)
    finally:
        collection.close()
    log = RecordLog(tmp_path / "run" / RECORDS_FILE)
    for eval_mode, mode in (("cascade", "auto"), ("large", "large")):
        for qid, _, retrieve in QUESTIONS:
            record, body = log.records[eval_mode, qid], served[mode, qid]
            assert record.error is None
            assert record.answer == body["answer"]
            assert [c.model for c in record.calls] == rows[body["id"]].models.split(",")
            assert record.escalated == body["escalated"] == (mode == "auto")
            assert record.passages == body["trimmed"]["kept"] and (record.passages > 0) == retrieve
            usage = body["usage"]
            assert (record.tokens("prompt"), record.tokens("cached"), record.tokens("output")) == \
                (usage["prompt"], usage["cached"], usage["completion"])
            assert record.cost == pytest.approx(body["cost"], rel=1e-12)
    log.close()


def _pipeline(llm, pair=("small", "large")) -> Pipeline:
    return Pipeline(llm, PRICES, pair=pair)


def _terms(thinking: dict | None = None, **policy) -> Terms:
    thinking = thinking or {"easy": 0, "medium": 64, "hard": 256}
    return Terms("acme", Policy("small", ("small", "large"), thinking, 0.5, **policy), 400, 32, b"salt-acme")


def test_a_clients_thinking_budget_of_zero_is_kept_and_none_lets_the_route_decide(llm):
    p, terms = _pipeline(llm), _terms(classifier=False)
    routed = p.plan(terms, Query("t5 t6"), None, "r1")
    assert routed.route.thinking_tokens == 64 and routed.params.max_thinking_tokens == 64   # the tenant's medium
    zero = p.plan(terms, Query("t5 t6", requested_thinking=0), None, "r2")
    # 0 is no thinking from the request to the engine: no span, no thinking instruction.
    assert zero.route.thinking_tokens == zero.params.max_thinking_tokens == 0
    assert len(zero.prompt_ids) < len(routed.prompt_ids)
    assert zero.route.reason.endswith("thinking budget 0 from the client")
    chosen = p.plan(terms, Query("t5 t6", requested_thinking=16), None, "r3")
    assert chosen.params.max_thinking_tokens == 16
    explicit = p.plan(terms, Query("t5 t6", mode="large"), None, "r4")
    assert (explicit.route.model, explicit.route.source, explicit.params.max_thinking_tokens) == ("large", "client", 0)
    with pytest.raises(Refused) as e:
        p.plan(terms, Query("t5 t6", requested_thinking=257), None, "r5")
    assert (e.value.status, e.value.code, e.value.param) == (422, "over_thinking_budget", "thinking_budget")


def test_the_cascade_says_which_call_comes_next(llm):
    p = _pipeline(llm)
    answer = p.answer(p.plan(_terms(classifier=False), Query("t5 t6 t7"), None, "req"))
    first = answer.next_call()
    assert (first.model, first.request_id, first.draft) == ("small", "req", None) and answer.may_escalate
    completion = llm.generate([first.prompt_ids], first.params, model="small")[0]
    verdict = answer.finish(completion)
    assert verdict is not None and answer.route.confidence == verdict.confidence
    second = answer.next_call()
    if verdict.escalate:
        assert (second.model, second.request_id, answer.route.model) == ("large", "req-escalated", "large")
        assert second.draft is None          # this engine verifies no drafts for the large model
    else:
        assert second is None and answer.route.model == "small"
    assert answer.cost() == pytest.approx(
        (len(completion.prompt_token_ids) - completion.num_cached_tokens) * PRICES["small"].input / 1e6
        + completion.num_cached_tokens * PRICES["small"].cached_input / 1e6
        + len(completion.token_ids) * PRICES["small"].output / 1e6)
    single = p.answer(p.plan(_terms(escalation=False, classifier=False), Query("t5 t6 t7"), None, "one"))
    call = single.next_call()
    assert not single.may_escalate
    assert single.finish(llm.generate([call.prompt_ids], call.params, model="small")[0]) is None
    assert single.next_call() is None


def _early_router(tmp_path, tokens: int = 4):
    """A router that judges on the first `tokens` with the stated rule; with threshold 1 every
    first answer is doomed, so the cascade cuts each one at that many tokens."""
    from router.confidence import ConfidenceModel, EarlyExit
    from router.model import RouterModel
    router = RouterModel(None, ConfidenceModel(), EarlyExit(tokens, ConfidenceModel()))
    router.save(tmp_path / "early.joblib")
    return RouterModel.load(tmp_path / "early.joblib")


def test_early_escalation_cuts_the_small_answer_and_drafts_with_its_prefix(tmp_path, llm, embedder):
    from litestar.testing import TestClient
    _early_router(tmp_path)
    bodies, rows = {}, {}
    for early in (True, False):
        toml = ("escalation_threshold = 1.0\n" + tenant_toml(KEYS["alpha"], salt=f"salt-early-{early}")
                + f"[router]\nclassifier = false\nearly_escalation = {str(early).lower()}\n")
        gw = make_gateway(tmp_path / f"gw-{early}", llm, embedder, {"alpha": toml},
                          router=RouterConfig(str(tmp_path / "early.joblib")))
        with TestClient(create_app(gw)) as c:
            wait_ready(c)
            large = c.post("/v1/ask", json={"question": "t5 t6 t7", "mode": "large"}, headers=auth()).json()
            r = c.post("/v1/ask", json={"question": "t5 t6 t7"}, headers=auth())
            assert r.status_code == 200, r.text
            bodies[early], rows[early] = r.json(), gw.ledger.rows()[-1]
            counted = re.search(r"^sluice_early_escalations_total (\S+)$", c.get("/metrics").text, re.M)
            assert float(counted.group(1) if counted else 0) == float(early)
        assert bodies[early]["answer"] == large["answer"] and bodies[early]["escalated"]
    cut, whole = bodies[True], bodies[False]
    assert "after 4 tokens" in cut["route_reason"] and "after" not in whole["route_reason"]
    # The small call stopped at its 4th token (a step may have made one more) instead of all 32.
    assert 4 <= cut["usage"]["completion"] - 32 <= 5 and whole["usage"]["completion"] == 64
    assert cut["cost"] < whole["cost"]
    assert rows[True].models == "small,large" and rows[True].completion_tokens == cut["usage"]["completion"]


def test_an_answer_that_ends_on_the_step_after_the_early_verdict_still_escalates_with_its_route(tmp_path, llm,
                                                                                                  embedder):
    """The step thread runs a step ahead of the gateway: when the small answer's last token
    comes on the step after the one the early verdict read, the request is finished before
    the cut reaches the engine, and its completion is still on its way in the stream (issue
    38: /v1/ask and /v1/chat/completions answered 500, the route never sent). Every way of
    asking gets the large model's answer with its route, and the ledger bills both calls."""
    from litestar.testing import TestClient

    from tests.test_gateway_support import parse_sse
    _early_router(tmp_path, tokens=4)
    toml = ("escalation_threshold = 1.0\n" + tenant_toml(KEYS["alpha"], salt="salt-early-race")
            + "[router]\nclassifier = false\n")
    gw = make_gateway(tmp_path / "gw", llm, embedder, {"alpha": toml},
                      router=RouterConfig(str(tmp_path / "early.joblib")))
    question = "t5 t6 t9"
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        large = c.post("/v1/ask", json={"question": question, "mode": "large", "max_output_tokens": 5},
                       headers=auth()).json()
        ask = c.post("/v1/ask", json={"question": question, "max_output_tokens": 5}, headers=auth())
        chat = c.post("/v1/chat/completions", json={"model": "auto", "max_tokens": 5, "messages": [
            {"role": "user", "content": question}]}, headers=auth())
        streamed = c.post("/v1/ask", json={"question": question, "max_output_tokens": 5, "stream": True},
                          headers=auth())
        chunks = c.post("/v1/chat/completions", json={"model": "auto", "max_tokens": 5, "stream": True,
                                                      "stream_options": {"include_usage": True},
                                                      "messages": [{"role": "user", "content": question}]},
                        headers=auth())
    assert [r.status_code for r in (ask, chat, streamed, chunks)] == [200] * 4, [ask.text, chat.text]
    body, completion = ask.json(), chat.json()
    assert (body["model"], body["escalated"], body["answer"]) == ("large", True, large["answer"])
    assert "after 4 tokens" in body["route_reason"]
    # The small answer ran whole (its 5 tokens), then the large one: both billed.
    assert body["usage"]["completion"] == 10 and body["cost"] > large["cost"]
    assert completion["model"] == "large" and completion["choices"][0]["message"]["content"] == large["answer"]
    assert completion["sluice"]["route"]["escalated"]
    frames = parse_sse(streamed.text)
    assert frames[0][0] == "meta" and frames[-1][0] == "done"
    meta = msgspec.json.decode(frames[0][1])
    assert (meta["route"]["model"], meta["route"]["escalated"]) == ("large", True)
    assert "".join(msgspec.json.decode(d)["text"] for e, d in frames if e == "token") == large["answer"]
    data = [msgspec.json.decode(d) for _, d in parse_sse(chunks.text)[:-1]]
    assert data[0]["model"] == "large" and "".join(
        d["choices"][0]["delta"].get("content", "") for d in data if d["choices"]) == large["answer"]
    rows = {row.request_id: row for row in gw.ledger.rows()}
    ids = [body["id"], completion["id"].removeprefix("chatcmpl-"), meta["id"], data[0]["id"].removeprefix("chatcmpl-")]
    assert len(rows) == 5 and all((rows[i].models, rows[i].completion_tokens) == ("small,large", 10) for i in ids)
    # OpenAI's usage counts the completion returned (max_tokens 5), sluice_billed both calls;
    # the two prompts are the same question in the same template.
    for usage, row in ((completion["usage"], rows[ids[1]]), (data[-1]["usage"], rows[ids[3]])):
        billed = usage["sluice_billed"]
        assert (usage["completion_tokens"], usage["total_tokens"]) == (5, usage["prompt_tokens"] + 5)
        assert (billed["completion_tokens"], billed["prompt_tokens"]) == (10, row.prompt_tokens)
        assert row.prompt_tokens == 2 * usage["prompt_tokens"] and billed["cached_tokens"] == row.cached_tokens


def test_an_eval_cascade_cuts_early_as_the_gateway_does(tmp_path, llm):
    router = _early_router(tmp_path, tokens=3)
    config = RunConfig("jsonl", [], None, 0, {"small": "tiny-1", "large": "tiny-2"}, PRICES, max_tokens=16)
    open_run(tmp_path / "run", config)
    examples = [Example(qid, "qa", question, ["x"], False) for qid, question, retrieve in QUESTIONS if not retrieve]
    modes = [Mode("cascade", "auto", escalation=True, threshold=1.0), Mode("large", "large")]
    run_modes(tmp_path / "run", config, examples, modes, pipeline_for(llm, config, router), None, 2, progress=False)
    log = RecordLog(tmp_path / "run" / RECORDS_FILE)
    for e in examples:
        cascade, large = log.records["cascade", e.id], log.records["large", e.id]
        small, big = cascade.calls
        assert (small.model, small.finish_reason, big.model) == ("small", "abort", "large")
        assert 3 <= small.output_tokens <= 4 and cascade.answer == large.answer
    log.close()


def test_plan_routes_a_closed_book_question_by_the_closed_book_margin(tmp_path, llm):
    """The pipeline tells the router the question's kind: a question asked without a
    collection goes by the tenant's closed-book margin, not its margin for retrieved ones."""
    from router.model import train
    from tests.test_router import HashEmbedder, write_kinds
    router, _ = train(write_kinds(tmp_path), HashEmbedder())
    p = Pipeline(llm, PRICES, router=router, embedder=HashEmbedder(), pair=("small", "large"))
    plan = lambda **margins: p.plan(_terms(thinking={"easy": 0, "medium": 0, "hard": 256}, **margins),
                                    Query("why did the empire fall and what followed v2"), None, "r").route
    # Where thinking answers it (a hard question), the closed-book margin of 0 takes the best arm...
    best = plan(arm_margin=1.0, closed_book_margin=0.0)
    assert (best.arm, best.thinking_tokens) == ("large+think256", 256) and best.reason.endswith("is the best")
    # ...and a wide one the cheapest, whatever the margin for retrieved questions says.
    cheap = plan(arm_margin=0.0, closed_book_margin=1.0)
    assert cheap.arm == "small" and "within 1.00 of the best, large+think256" in cheap.reason


def test_a_tenants_passage_selection_cuts_the_passages_to_what_the_question_asks(tmp_path, llm, embedder):
    """With passage_selection the prompt holds the sentence that answers, cited by its document,
    in a budget too small for its whole passage; without it, whole passages or none."""
    from dataclasses import replace as with_

    from retrieval.prompt import passage, system_text
    store = CollectionStore(tmp_path / "collections", embedder)
    collection = store.collection("acme", "kb")
    collection.ingest([Document(d["id"], d["text"], d["title"]) for d in DOCS["documents"]])
    p, question = _pipeline(llm), "Which landmark stands in Paris?"
    paris = collection.chunks("paris")[0]
    count = lambda text: len(llm.prompter("small").encode(text))
    # Room for the instructions, the question and all but the last few tokens of the Paris passage.
    budget = count(system_text([])) + count(question) + count("\n\n" + passage(3, paris)) - 4
    try:
        found = {}
        for selection in (False, True):
            terms = with_(_terms(classifier=False), context_budget=budget, selection=selection)
            ctx = p.plan(terms, Query(question, collection="kb", mode="small"), collection, "r").context
            assert ctx.trimmed.tokens <= budget
            found[selection] = {c.doc_id: c.text for c in ctx.trimmed.chunks}
        assert "paris" not in found[False]
        assert "The Eiffel Tower stands in Paris." in found[True].get("paris", "")
    finally:
        store.close()
