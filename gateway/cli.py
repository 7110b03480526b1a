"""The `sluice` command. Until the HTTP gateway lands, `sluice demo` (what `make run`
starts) loads the default models and answers a few questions, streaming tokens."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.store import StoreError

DEFAULT_ENGINE = EngineConfig(models={"small": ModelEntry("qwen2.5-coder-0.5b"),
                                      "large": ModelEntry("qwen2.5-coder-1.5b")}, memory_budget_gb=12.0)

DEMO_QUESTIONS = [
    ("small", "What is the capital of France? Answer in one sentence."),
    ("small", "Write a Python one-liner that reverses a string s."),
    ("large", "In one sentence: why does a paged KV cache help an LLM server?"),
]


async def _answer(engine: AsyncEngine, model: str, question: str, max_tokens: int) -> None:
    tok = engine.engine.worker(model).tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": question}])
    print(f"\n[{model}] {question}\n> ", end="", flush=True)
    start, n = time.monotonic(), 0
    async for out in engine.stream(prompt, SamplingParams(max_tokens=max_tokens), model=model):
        print(out.text_delta, end="", flush=True)
        n += len(out.new_token_ids)
    elapsed = time.monotonic() - start
    print(f"\n  ({n} tokens in {elapsed:.1f}s, {n / elapsed:.1f} tok/s)")


async def _run(config: EngineConfig, questions: list[tuple[str, str]], max_tokens: int) -> None:
    engine = AsyncEngine(LLMEngine(config))
    for model, question in questions:
        await _answer(engine, model, question, max_tokens)
    await engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: a workload-aware RAG gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="load the default models and answer a few questions")
    ask = sub.add_parser("ask", help="answer one question with one of the default models")
    ask.add_argument("question")
    ask.add_argument("--model", default="small", choices=sorted(DEFAULT_ENGINE.models))
    for p in (sub.choices["demo"], ask):
        p.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            asyncio.run(_run(DEFAULT_ENGINE, DEMO_QUESTIONS, args.max_tokens))
        else:
            config = EngineConfig(models={args.model: DEFAULT_ENGINE.models[args.model]})
            asyncio.run(_run(config, [(args.model, args.question)], args.max_tokens))
    except (StoreError, ValueError) as exc:
        print(f"sluice: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
