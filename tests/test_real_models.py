"""Real models from their pinned packages, through the store, against transformers."""
import pytest
import torch
import transformers

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from models.store import resolve

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea.", "What is 12 times 7?"]


@pytest.fixture(scope="module")
def smol_folder():
    return resolve("smollm2-135m", progress=False)


def test_chat_template_matches_transformers(smol_folder):
    ours = Tokenizer(smol_folder)
    ref = transformers.AutoTokenizer.from_pretrained(smol_folder)
    for messages in ([{"role": "user", "content": "Hi there"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
        text = ours.apply_chat_template(messages)
        assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]


def reference_greedy(ref, ids: list[int], n: int) -> list[int]:
    """transformers' greedy decoding, past the end-of-turn token too (generate's
    min_new_tokens would mask that token and change the argmax instead)."""
    out, past, cur = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            step = ref(cur, past_key_values=past, use_cache=True)
            past, token = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(token)
            cur = torch.tensor([[token]])
    return out


def test_smollm2_greedy_equals_transformers(smol_folder):
    engine = LLMEngine(EngineConfig(models={"smol": ModelEntry("smollm2-135m")}, max_kv_blocks=512), progress=False)
    tok = engine.worker("smol").tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    ref = transformers.AutoModelForCausalLM.from_pretrained(smol_folder, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        assert got.token_ids == reference_greedy(ref, tok.encode(prompt), 32)
    assert "Paris" in ours[0].text


def test_qwen_small_answers_a_factual_question():
    engine = LLMEngine(EngineConfig(models={"small": ModelEntry("qwen2.5-coder-0.5b")}, max_kv_blocks=256),
                       progress=False)
    tok = engine.worker("small").tokenizer
    prompt = tok.apply_chat_template([{"role": "user",
                                       "content": "What is the capital of France? Answer in one word."}])
    answer = engine.generate([prompt], SamplingParams(max_tokens=16))[0]
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop"
