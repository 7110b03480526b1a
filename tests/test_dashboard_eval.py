"""Dollars saved, two ways, on the same questions: `sluice eval`'s (the large-only run's cost
minus the cascade run's, both measured) and the operator's view's (the cascade replayed
through the gateway, its ledger's tokens per call priced at the large model's prices).

They can agree only where the estimate's assumption holds: the large model would have written
as many tokens as the answer given, and read as many from the prefix cache. Here it does by
construction: tiny models that never emit EOS (every answer runs to max_output_tokens) and an
engine without prefix caching. With real models the estimate is an estimate (docs/gateway.md)."""
from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from evals.records import RecordLog
from evals.runner import MODES, RECORDS_FILE, RunConfig, load_dataset, open_run, pipeline_for, routed_modes, run_modes
from evals.summary import mode_summary
from gateway.config import RouterConfig
from gateway.http.app import create_app
from tests.conftest import make_tiny_model
from tests.test_dashboard import OPERATOR, operator
from tests.test_gateway_support import PRICES, _no_eos, embedder, make_gateway, tenant_toml, wait_for, wait_ready  # noqa: F401

KEY = "sk-replay"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    small = _no_eos(make_tiny_model(tmp_path_factory.mktemp("replay-small"), "qwen2", seed=1))
    large = _no_eos(make_tiny_model(tmp_path_factory.mktemp("replay-large"), "qwen2", seed=2))
    return LLMEngine(EngineConfig(models={"small": ModelEntry(str(small)), "large": ModelEntry(str(large))},
                                  block_size=16, max_kv_blocks=512, memory_budget_gb=1.0, prefix_caching=False),
                     progress=False)


def test_dollars_saved_on_a_replay_match_the_evals(tmp_path, engine, embedder):
    questions = [" ".join(f"t{(7 * i + 3 * j) % 120 + 1}" for j in range(4 + i % 9)) for i in range(16)]
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": q, "answers": ["t1"]}) + "\n"
                            for i, q in enumerate(questions)))
    config = RunConfig("jsonl", [str(data)], None, 0, {"small": "tiny-1", "large": "tiny-2"}, PRICES,
                       context_budget=400, max_tokens=MAX_TOKENS)
    dataset = load_dataset(config)
    folder = tmp_path / "run"
    open_run(folder, config)
    pipeline = pipeline_for(engine, config)
    # A threshold between the small answers' middle two confidences: half the questions escalate.
    run_modes(folder, config, dataset.examples, [MODES["small"]], pipeline, None, 1, progress=False)
    sure = sorted(pipeline.confidence(r.calls[0].logprobs).value for r in RecordLog(folder / RECORDS_FILE).of_mode(
        "small"))
    threshold = round((sure[len(sure) // 2 - 1] + sure[len(sure) // 2]) / 2, 6)
    cascade = routed_modes(threshold=threshold)["cascade"]
    run_modes(folder, config, dataset.examples, [cascade, MODES["large"]], pipeline, None, 1, progress=False)
    log = RecordLog(folder / RECORDS_FILE)
    runs = {m: mode_summary(log.of_mode(m)) for m in (cascade.name, "large")}
    eval_saved = runs["large"]["cost"]["total"] - runs[cascade.name]["cost"]["total"]
    escalated = sum(r.escalated for r in log.of_mode(cascade.name))
    assert 0 < escalated < len(questions), "the cascade should escalate some questions, not all"

    # The same questions through the gateway: a tenant whose cascade is the eval's.
    tenant = tenant_toml(KEY, context=400, output=MAX_TOKENS, salt="replay-salt").replace(
        "[limits]", f"escalation_threshold = {threshold}\n[router]\nclassifier = false\n[limits]")
    gw = make_gateway(tmp_path / "gw", engine, embedder, {"replay": tenant}, router=RouterConfig(), **OPERATOR)
    with TestClient(create_app(gw)) as client:
        wait_ready(client)
        for q in questions:
            r = client.post("/v1/ask", json={"question": q, "max_output_tokens": MAX_TOKENS},
                            headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
        read = lambda: client.get("/v1/admin/summary?window=hour&tenant=replay", headers=operator()).json()
        wait_for(lambda: read()["tenants"][0]["requests"] == len(questions))     # rows are folded after answers
        summary = read()
    figures = summary["tenants"][0]
    assert figures["escalations"] == escalated
    assert figures["cost"] == pytest.approx(runs[cascade.name]["cost"]["total"], rel=1e-6)
    assert figures["large_alone_cost"] == pytest.approx(runs["large"]["cost"]["total"], rel=0.01)
    assert figures["saved"] == pytest.approx(eval_saved, rel=0.01)
    print(f"\nsaved on {len(questions)} questions ({escalated} escalated): eval {eval_saved:.6f}, "
          f"operator's view {figures['saved']:.6f} ({figures['saved'] / eval_saved - 1:+.4%})")
