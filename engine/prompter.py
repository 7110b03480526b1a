"""What composing a prompt for a model needs, without its weights: the tokenizer, the chat
template, how the model is asked to think, and how long a prompt it reads. The engine holds
one per served model; the Ray ingress loads them alone to compute prompts as replicas will."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from engine.config import EngineConfig, ModelConfig, ThinkingConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from models.store import resolve


@dataclass(frozen=True)
class Prompter:
    tokenizer: Tokenizer
    thinking: ThinkingConfig
    max_position: int                    # the model reads at most max_position - 1 prompt tokens

    @classmethod
    def load(cls, config: EngineConfig, model: str) -> Prompter:
        """From the model store: the tokenizer and config.json only, no weights."""
        folder = resolve(config.models[model].source, progress=False)
        return cls(Tokenizer(folder), config.models[model].thinking, ModelConfig.from_folder(folder).max_position)

    @cached_property
    def forced_tokens(self) -> int:
        """The most tokens budget forcing writes after a spent thinking budget (the nudge and
        the closing marker): output past the budget that a request must still reserve."""
        return len(self.encode(self.thinking.forced))

    def probe_tokens(self, params: SamplingParams) -> int:
        """The most tokens early exit's probes may cost a request (each the closing marker and
        its answer tokens, one every `every` thinking tokens): what a request must reserve."""
        ee = params.thinking_exit
        if ee is None or not params.max_thinking_tokens:
            return 0
        return (params.max_thinking_tokens - 1) // ee.every * (self.marker_tokens + ee.answer_tokens)

    @cached_property
    def marker_tokens(self) -> int:
        """The tokens of the marker that closes a span early (what every probe appends)."""
        return len(self.encode(self.thinking.early_close))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def chat_text(self, messages: list[dict], thinking: bool = False) -> str:
        """The model's chat template over `messages`; with `thinking` and a model that does not
        think natively, the system message also asks for a thinking span."""
        if thinking and not self.thinking.native:
            system = [m["content"] for m in messages[:1] if m.get("role") == "system"]
            content = "\n\n".join(system + [self.thinking.instruction])
            messages = [{"role": "system", "content": content}] + messages[len(system):]
        return self.tokenizer.apply_chat_template(messages)

    def chat(self, messages: list[dict], thinking: bool = False) -> list[int]:
        return self.encode(self.chat_text(messages, thinking))


class Prompters:
    """An engine config's prompters without the engine, each loaded on first use: what a
    process that composes prompts but serves none (the Ray ingress) plans with."""

    def __init__(self, config: EngineConfig):
        self.config, self.loaded = config, {}

    def prompter(self, model: str) -> Prompter:
        if model not in self.loaded:
            self.loaded[model] = Prompter.load(self.config, model)
        return self.loaded[model]

    def verifies_drafts(self, model: str) -> bool:
        return False                     # it runs no calls
