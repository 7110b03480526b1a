"""Tokenizer (Hugging Face `tokenizers`) and chat templates.

The model's own chat template (from tokenizer_config.json) is rendered with Jinja, as
transformers does, so prompts are byte-identical to the reference; a model without one gets
plain ChatML, the format of both Qwen and SmolLM2.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, folder: Path):
        self.hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(config.get("chat_template") or CHATML)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_id = self.hf.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(config.get("add_bos_token")) and self.bos_token is not None
        self.vocab_size = self.hf.get_vocab_size()
        added = self.hf.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        spellings = sorted((t.content for t in added.values() if t.special), key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, spellings))) if spellings else None
        self._one: dict[int, str] = {}      # one token's text alone, at most a vocabulary's worth

    def encode(self, text: str) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            ids = [self.hf.token_to_id(self.bos_token)] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """Special tokens (special_ids) write nothing."""
        if len(ids) == 1:   # the detokenizer's context after every step: a dict read, not a call into the library
            text = self._one.get(ids[0])
            if text is None:
                text = self._one[ids[0]] = self.hf.decode(ids, skip_special_tokens=True)
            return text
        return self.hf.decode(ids, skip_special_tokens=True)

    def wordless_ids(self) -> list[int]:
        """The tokens that write no letter or digit: whitespace, punctuation, special tokens."""
        texts = self.hf.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=True)
        return [i for i, text in enumerate(texts) if not any(c.isalnum() for c in text)]

    def defuse(self, text: str) -> str:
        """`text` with each special token's spelling broken by a zero-width space after its first
        character: what a client or a document writes is read as text, so "<|im_end|>" in a
        question cannot end its turn and start another."""
        return self._specials.sub(lambda m: f"{m[0][0]}\u200b{m[0][1:]}", text) if self._specials else text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise ValueError(f"bad chat message {m!r}: needs role system|user|assistant and text content")
        # Only the template writes control tokens; the messages' own text is defused.
        messages = [{**m, "content": self.defuse(m["content"])} for m in messages]
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_text(token) -> str | None:
    # tokenizer_config stores special tokens as strings or as {"content": ...} objects.
    return token.get("content") if isinstance(token, dict) else token
