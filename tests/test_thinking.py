"""Thinking budgets on a tiny random model whose markers are words of its vocabulary."""
import pytest

from engine.config import EngineConfig, ModelEntry, SpecConfig, ThinkingConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.test_engine import folder, prompts  # noqa: F401  (fixture)

OPEN, CLOSE, NUDGE = 120, 121, 122


def engine(folder, close=CLOSE, speculative=False, native=False):
    thinking = ThinkingConfig(open=f"t{OPEN}", close=f"t{close}", nudge=f"t{NUDGE} ", native=native)
    models = {"tiny": ModelEntry(str(folder), thinking=thinking)}
    if speculative:      # the model drafts for itself: every step appends several tokens at once
        models["draft"] = ModelEntry(str(folder))
    spec = SpecConfig(target="tiny", draft="draft", prompt_lookup=False, max_k=4, draft_cost=0.1, verify_cost=0.05) \
        if speculative else None
    return LLMEngine(EngineConfig(models=models, block_size=4, max_kv_blocks=256, memory_budget_gb=1.0,
                                  speculative=spec), progress=False)


def thinking_span(c, budget):
    out = c.token_ids
    return out[:out.index(CLOSE) + 1] if CLOSE in out else out


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("budget", [1, 5, 13])
def test_budget_is_never_exceeded_and_the_answer_follows(folder, budget, speculative):
    e = engine(folder, speculative=speculative)
    c = e.generate(prompts(1, seed=31), SamplingParams(max_tokens=6, ignore_eos=True, max_thinking_tokens=budget))[0]
    assert c.prompt_token_ids[-1] == OPEN
    assert c.num_thinking_tokens == budget
    assert c.token_ids[budget:budget + 2] == [NUDGE, CLOSE]           # forced, right at the budget
    assert len(c.token_ids) == budget + 2 + 6                          # then a 6-token answer
    assert c.text == e.worker("tiny").tokenizer.decode(c.token_ids[budget + 2:])
    assert f"t{NUDGE}" not in c.text and c.thinking_text.split() == [f"t{t}" for t in c.token_ids[:budget]]


def test_natural_close_within_budget_is_kept(folder):
    free = engine(folder).generate(prompts(1, seed=32), SamplingParams(max_tokens=12, ignore_eos=True,
                                                                       max_thinking_tokens=50))[0]
    marker = free.token_ids[3]                        # a token this model writes anyway: call it the close
    e = engine(folder, close=marker)
    c = e.generate(prompts(1, seed=32), SamplingParams(max_tokens=5, ignore_eos=True, max_thinking_tokens=50))[0]
    first = free.token_ids.index(marker)
    assert c.num_thinking_tokens == first + 1 and NUDGE not in c.token_ids
    assert c.token_ids[:first + 1] == free.token_ids[:first + 1]
    assert len(c.token_ids) == first + 1 + 5


@pytest.mark.parametrize("speculative", [False, True])
def test_a_closed_span_is_never_followed_by_an_empty_answer(folder, speculative):
    free = engine(folder).generate(prompts(1, seed=32), SamplingParams(max_tokens=12, ignore_eos=True,
                                                                       max_thinking_tokens=50))[0]
    marker = free.token_ids[3]
    after = next(t for t in free.token_ids[free.token_ids.index(marker) + 1:] if t != marker)
    e = engine(folder, close=marker, speculative=speculative)
    # `after` is what the model writes once the span closes: as a stop token it would end the
    # turn with nothing answered, so it is banned there; once the answer has begun it stops.
    params = SamplingParams(max_tokens=40, ignore_eos=True, max_thinking_tokens=50, stop_token_ids=[after])
    c = e.generate(prompts(1, seed=32), params)[0]
    end = c.token_ids.index(marker) + 1
    assert c.num_thinking_tokens == end and c.token_ids[:end] == free.token_ids[:end]
    assert c.token_ids[end] != after and c.text.strip()
    assert c.finish_reason == "length" or c.token_ids[-1] == after
    # Without a thinking span nothing is banned: the same stop token ends the answer at once.
    plain = e.generate([c.prompt_token_ids + c.token_ids[:end]], SamplingParams(max_tokens=5, ignore_eos=True,
                                                                                stop_token_ids=[after]))[0]
    assert plain.token_ids == [after]


def test_an_answer_of_line_breaks_gives_way_to_words(folder, tmp_path):
    """A model that answered inside its span writes line breaks after it until max_tokens (stop
    tokens are banned there): past BLANK_TOKENS tokens without a letter or digit, every such
    token is banned too, and the answer's next token is a word."""
    import json
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.stop_checker import BLANK_TOKENS
    from tests.conftest import TINY_VOCAB
    free = engine(folder).generate(prompts(1, seed=32), SamplingParams(max_tokens=12, ignore_eos=True,
                                                                       max_thinking_tokens=50))[0]
    marker = free.token_ids[3]
    end = free.token_ids.index(marker) + 1
    breaks = free.token_ids[end:end + BLANK_TOKENS + 1]     # what it writes after the span, made wordless
    assert len(set(breaks)) == len(breaks) and not {marker, OPEN, CLOSE, NUDGE} & set(breaks)
    wordless = shutil.copytree(folder, tmp_path / "wordless")
    vocab = {(("\n" if i == breaks[0] else "!" * (breaks.index(i) + 1)) if i in breaks else f"t{i}"): i
             for i in range(TINY_VOCAB - 1)} | {"<eos>": TINY_VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<eos>"])
    tok.save(str(wordless / "tokenizer.json"))
    (wordless / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    # (eos is its stop token: a request without one may end its turn anywhere, and bans nothing.)
    c = engine(wordless, close=marker).generate(prompts(1, seed=32), SamplingParams(max_tokens=12,
                                                                                    max_thinking_tokens=50))[0]
    answer = c.token_ids[end:]
    assert c.token_ids[:end] == free.token_ids[:end] and answer[:BLANK_TOKENS] == breaks[:BLANK_TOKENS]
    assert answer[BLANK_TOKENS] != breaks[BLANK_TOKENS] and answer[BLANK_TOKENS] not in breaks
    assert any(ch.isalnum() for ch in c.text)


@pytest.mark.parametrize("speculative", [False, True])
def test_a_stop_token_inside_the_span_closes_it_and_the_answer_follows(folder, speculative):
    free = engine(folder).generate(prompts(1, seed=33), SamplingParams(max_tokens=12, ignore_eos=True,
                                                                       max_thinking_tokens=50))[0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    c = engine(folder, speculative=speculative).generate(
        prompts(1, seed=33), SamplingParams(max_tokens=8, ignore_eos=True, max_thinking_tokens=50,
                                            stop_token_ids=[stop]))[0]
    assert c.num_thinking_tokens == first and c.token_ids[:first] == free.token_ids[:first]
    assert c.token_ids[first] == CLOSE and NUDGE not in c.token_ids     # closed in the stop's place, no nudge
    answer = c.token_ids[first + 1:]
    assert answer and answer[0] != stop and c.text.strip()
    assert len(answer) == 8 or (answer[-1] == stop and c.finish_reason == "stop")


def test_budget_zero_means_no_thinking(folder):
    """0 is the default: no span for a model that thinks only when asked; a native thinker,
    which would open one itself, gets its span opened and closed in the prompt."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True, max_thinking_tokens=0)
    plain = engine(folder).generate(prompts(1), SamplingParams(max_tokens=4, ignore_eos=True))[0]
    zero = engine(folder).generate(prompts(1), sp)[0]
    assert zero.prompt_token_ids == plain.prompt_token_ids and zero.token_ids == plain.token_ids
    native = engine(folder, native=True).generate(prompts(1), sp)[0]
    assert native.prompt_token_ids[-2:] == [OPEN, CLOSE] and native.prompt_token_ids[:-2] == plain.prompt_token_ids
    assert native.num_thinking_tokens == 0 and len(native.token_ids) == 4


def test_include_thinking_returns_the_span_too(folder):
    e = engine(folder)
    sp = dict(max_tokens=3, ignore_eos=True, max_thinking_tokens=4)
    hidden = e.generate(prompts(1), SamplingParams(**sp))[0]
    shown = e.generate(prompts(1), SamplingParams(**sp, include_thinking=True))[0]
    assert shown.text.startswith(hidden.thinking_text) and shown.text.endswith(hidden.text)
    assert f"t{CLOSE}" in shown.text and f"t{CLOSE}" not in hidden.text


def test_prompted_thinking_for_a_non_native_model(folder):
    e = engine(folder)
    p = e.prompter().chat_text([{"role": "user", "content": "hi"}], thinking=True)
    assert ThinkingConfig().instruction in p
    assert ThinkingConfig().instruction not in e.prompter().chat_text([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        SamplingParams(max_thinking_tokens=-1)
