"""Early exit from thinking (engine/early_exit.py) on a tiny random model whose markers are
words of its vocabulary: probes read exactly what a request forked at their point would
answer, a request waits for them so its own tokens never change, and an exit lands where the
probe forked and answers what it read: the same tokens as a request forked there."""
import pytest

from engine.early_exit import answer_key, settled
from engine.sampling_params import SamplingParams, ThinkingExit
from engine.sequence import Probe
from tests.test_engine import folder, prompts  # noqa: F401  (fixture)
from tests.test_thinking import CLOSE, engine

BUDGET = 40


def words(text):
    return [int(w[1:]) for w in text.split()]


def think(folder, early_exit=None, stop_token_ids=(), seed=41):
    e = engine(folder)
    params = SamplingParams(max_tokens=6, ignore_eos=True, max_thinking_tokens=BUDGET, thinking_exit=early_exit,
                            stop_token_ids=list(stop_token_ids))
    return e, e.generate(prompts(1, seed=seed), params)[0]


def test_observed_probes_read_what_a_fork_would_answer_and_change_nothing(folder):
    _, plain = think(folder)
    e, seen = think(folder, ThinkingExit(every=8, answer_tokens=5, observe=True))
    assert seen.token_ids == plain.token_ids and seen.num_thinking_tokens == BUDGET and not seen.thinking_exited
    assert [p.at for p in seen.probes] == [8, 16, 24, 32]      # none at the budget: the span closes there
    for p in seen.probes:
        fork = seen.prompt_token_ids + plain.token_ids[:p.at] + [CLOSE]
        alone = engine(folder).generate([fork], SamplingParams(max_tokens=5))[0]     # an answer ends at eos
        line = alone.token_ids[:-1] if alone.finish_reason == "stop" else alone.token_ids
        assert words(p.text) == line and p.tokens == 1 + len(alone.token_ids)
        assert p.complete == (alone.finish_reason == "stop")
    stats = e.stats()["tiny"]
    assert stats["thinking_probes"] == 4 and stats["thinking_probe_tokens"] == seen.num_probe_tokens
    assert seen.num_probe_tokens == sum(p.tokens for p in seen.probes) > 4
    assert stats["thinking_early_exits"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_request_without_thinking_forks_no_probe(folder):
    e = engine(folder)
    c = e.generate(prompts(1, seed=41), SamplingParams(max_tokens=40, ignore_eos=True,
                                                       thinking_exit=ThinkingExit(every=4)))[0]
    assert len(c.token_ids) == 40 and c.probes == [] and e.stats()["tiny"]["thinking_probes"] == 0


def test_the_first_probe_forks_where_the_settings_say(folder):
    _, seen = think(folder, ThinkingExit(every=8, first=12, answer_tokens=3, observe=True))
    assert [p.at for p in seen.probes] == [12, 20, 28, 36]


def test_an_exit_lands_where_the_probe_forked_and_answers_what_it_read(folder):
    _, plain = think(folder, ThinkingExit(every=8, answer_tokens=8, observe=True))
    first = plain.probes[0]
    # A stop token the first probe writes after some text (never in the thinking before it)
    # ends its line there: a whole answer, which a lenient threshold takes.
    answer = words(first.text)
    k = next(i for i in range(1, len(answer)) if answer[i] not in plain.token_ids[:8] + answer[:i])
    e, c = think(folder, ThinkingExit(every=8, confidence=1e-9, agree=1, answer_tokens=8), stop_token_ids=[answer[k]])
    assert c.thinking_exited and c.num_thinking_tokens == 8
    assert c.token_ids == plain.token_ids[:8] + [CLOSE] + answer[:k + 1] and c.finish_reason == "stop"
    assert [(p.at, words(p.text), p.complete, p.taken) for p in c.probes] == [(8, answer[:k], True, True)]
    assert c.num_probe_tokens == 0 and c.num_billed_tokens == len(c.token_ids)      # its answer is the answer
    fork = c.prompt_token_ids + plain.token_ids[:8] + [CLOSE]
    alone = engine(folder).generate([fork], SamplingParams(max_tokens=6, ignore_eos=True,
                                                           stop_token_ids=[answer[k]]))[0]
    assert c.token_ids[9:] == alone.token_ids and c.text == alone.text and c.logprobs[-len(alone.logprobs):] == \
        pytest.approx(alone.logprobs, abs=1e-4)
    stats = e.stats()["tiny"]
    assert stats["thinking_early_exits"] == 1 and stats["thinking_probe_tokens"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_an_unsure_or_unsettled_answer_keeps_thinking(folder):
    _, plain = think(folder, ThinkingExit(every=8, answer_tokens=8, observe=True))
    answer = words(plain.probes[0].text)
    k = next(i for i in range(1, len(answer)) if answer[i] not in plain.token_ids[:8] + answer[:i])
    unsure = ThinkingExit(every=8, confidence=0.999999, agree=1, answer_tokens=8)
    _, c = think(folder, unsure, stop_token_ids=[answer[k]])
    assert not c.thinking_exited and c.probes[0].confidence < 0.999999
    assert c.token_ids[:8] == plain.token_ids[:8] and c.num_thinking_tokens > 8


def test_settled_needs_agreeing_whole_answers_and_a_sure_last_one():
    p = lambda text, conf=0.95, whole=True: Probe(8, text, conf, whole, 4)      # noqa: E731
    assert settled([p("x is 12"), p("The answer is 12.")], agree=2, confidence=0.9)
    assert not settled([p("The answer is 12.")], agree=2, confidence=0.9)        # too few
    assert not settled([p("12"), p("13")], agree=2, confidence=0.9)               # changed
    assert not settled([p("12"), p("12", conf=0.5)], agree=2, confidence=0.9)    # unsure
    assert not settled([p("12"), p("12", whole=False)], agree=2, confidence=0.9)  # cut short
    assert settled([p("13"), p("Paris"), p(" paris ")], agree=2, confidence=0.9)
    assert answer_key("It costs $1,250.50 in all") == "1250.50" and answer_key("The  City") == "the city"


def test_abort_while_a_probe_reads_frees_everything(folder):
    e = engine(folder)
    params = SamplingParams(max_tokens=6, ignore_eos=True, max_thinking_tokens=BUDGET,
                            thinking_exit=ThinkingExit(every=4, answer_tokens=8))
    rid = e.add_request(prompts(1, seed=41)[0], params)
    while not e.requests[rid][1].waits_for_probe:
        e.step()
    assert e.abort(rid).finish_reason == "abort"
    while e.has_work():
        e.step()
    stats = e.stats()["tiny"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == stats["waiting"] == 0


@pytest.mark.parametrize("bad, key", [(dict(every=0), "every"), (dict(confidence=1.0), "confidence"),
                                      (dict(confidence=0.0), "confidence"), (dict(agree=0), "agree")])
def test_bad_settings_are_refused_with_the_key_named(bad, key):
    with pytest.raises(ValueError, match=f"thinking_exit.{key} must be"):
        SamplingParams(max_thinking_tokens=64, thinking_exit=ThinkingExit(**bad))


def test_a_tenant_turns_early_exit_on_with_its_settings(tmp_path):
    from gateway.tenants import load_tenant
    from tests.test_gateway import KEYS, tenant_toml
    path = tmp_path / "alpha.toml"
    path.write_text(tenant_toml(KEYS["alpha"]).replace(
        "[limits]", "[thinking_budget]\nhard = 512\nearly_exit = true\n[thinking_budget.exit]\nevery = 32\n"
                    "confidence = 0.8\n[limits]"))
    terms = load_tenant(path, {"small", "large"}).terms
    assert terms.thinking_exit == ThinkingExit(every=32, confidence=0.8)
    assert terms.policy.thinking == {"easy": 0, "medium": 0, "hard": 512}


def test_the_lab_simulates_exits_and_fixed_budgets_from_observed_probes():
    from evals.lab.exits import Trace, budget_outcome, calibration, exit_outcome, oracle, pareto, summarize
    p = lambda at, text, conf=0.95, whole=True: Probe(at, text, conf, whole, 5)     # noqa: E731
    # Right at 64 and 128 (12), wrong at 32 (10); 150 tokens of thinking in full, then right.
    t = Trace("q", [p(32, "10", 0.5), p(64, "12"), p(96, "12"), p(128, "12")], 150, 1.0, [0.0, 1.0, 1.0, 1.0])
    # An exit takes the deciding probe's answer: the probes before it are what it cost.
    assert exit_outcome(t, 1, 1, 0.4).__dict__ == {"thinking": 32, "probe_tokens": 0, "em": 0.0, "exited": True}
    assert exit_outcome(t, 1, 2, 0.9).__dict__ == {"thinking": 96, "probe_tokens": 10, "em": 1.0, "exited": True}
    assert exit_outcome(t, 2, 2, 0.9, first=2).__dict__ == {"thinking": 128, "probe_tokens": 5, "em": 1.0,
                                                            "exited": True}
    assert exit_outcome(t, 2, 2, 0.9).__dict__ == {"thinking": 150, "probe_tokens": 10, "em": 1.0, "exited": False}
    assert exit_outcome(t, 1, 1, 0.9, first=2).__dict__ == {"thinking": 64, "probe_tokens": 0, "em": 1.0,
                                                            "exited": True}
    assert exit_outcome(t, 1, 3, 0.99).__dict__ == {"thinking": 150, "probe_tokens": 20, "em": 1.0, "exited": False}
    # Read with a smaller answer cap, these 4-token answers (marker 1) would have been cut: never whole.
    assert exit_outcome(t, 1, 1, 0.4, answer_tokens=3, marker=1).__dict__ == \
        {"thinking": 150, "probe_tokens": 16, "em": 1.0, "exited": False}
    assert budget_outcome(t, 32).em == 0.0 and budget_outcome(t, 64).thinking == 64
    assert budget_outcome(t, 256).__dict__ == {"thinking": 150, "probe_tokens": 0, "em": 1.0, "exited": False}
    full = {"em": 1.0, "thinking_tokens": 150}
    row = summarize([exit_outcome(t, 1, 2, 0.9)], full)
    assert row["spent"] == 106 and row["spent_share"] == 106 / 150 and row["em_share"] == 1.0
    # The oracle exits at the first right probe (64), no probe before it, its answer taken; a
    # question no probe reads right costs its full thinking if that is right, else its first
    # probe's point; at 40% of full thinking's exact match it gives up the right answer that
    # saves the most (u's 200 - 32).
    u = Trace("u", [p(32, "1", 0.9)], 200, 1.0, [0.0])
    w = Trace("w", [p(32, "1", 0.9)], 90, 0.0, [0.0])
    bound = oracle([t, u, w], 1.0)
    assert (bound["em"], bound["thinking_tokens"], bound["probe_tokens"]) == (2 / 3, (64 + 200 + 32) / 3, 0)
    assert bound["spent_share"] == pytest.approx((64 + 200 + 32) / 440) and bound["em_share"] == 1.0
    assert oracle([t, u, w], 0.4)["spent"] == pytest.approx((64 + 32 + 32) / 3)
    # Calibration: t's unsure wrong probe and its three sure right ones (at 64 in the first half
    # of its 150 tokens).
    bins = {tuple(r["confidence"]): r for r in calibration([t])}
    assert (bins[0.5, 0.7]["probes"], bins[0.5, 0.7]["right"], bins[0.5, 0.7]["early_probes"]) == (1, 0.0, 1)
    assert (bins[0.9, 0.98]["probes"], bins[0.9, 0.98]["right"], bins[0.9, 0.98]["early_probes"],
            bins[0.9, 0.98]["early_right"]) == (3, 1.0, 1, 1.0)
    assert bins[0.0, 0.5]["right"] is None
    rows = [{"em": 0.5, "spent": 10}, {"em": 0.4, "spent": 20}, {"em": 0.9, "spent": 30}]
    assert pareto(rows) == [rows[0], rows[2]]


@pytest.mark.parametrize("text, message", [("every=0", "every must be >= 1"), ("speed=3", "expected KEY=VALUE"),
                                           ("confidence=high", "confidence must be a number")])
def test_the_eval_cli_refuses_bad_early_exit_settings_with_exit_code_2(text, message, capsys):
    from evals.__main__ import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "gsm8k", "--early-exit", text])
    assert e.value.code == 2 and message in capsys.readouterr().err
