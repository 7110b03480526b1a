"""GGUF -> Hugging Face folder: config.json, model.safetensors (float32), tokenizer files, and
gguf/blocks.safetensors, the file's own quantized blocks as they ship.

The engine reads Hugging Face folders; GGUF files (llama.cpp's format, how our pinned models
ship) are converted once by `convert_gguf` and cached by models/store.py. The float32 weights
serve the float path and the int8/int4 quantizers; the blocks serve the `gguf` precision,
which computes on the file's own quantization instead of quantizing its dequantized floats a
second time (engine/quantize.py, on kernels/gguf_quant.py).
Three things differ between the two formats and are undone here:
  * names: GGUF says `blk.3.attn_q.weight`, Hugging Face `model.layers.3.self_attn.q_proj.weight`;
  * shapes: GGUF lists dimensions fastest-first, so its [in, out] is numpy's (out, in);
  * for Llama only, llama.cpp's converter reorders the rows of q_proj and k_proj (see `unpermute`).
"""
from __future__ import annotations

import json
import re
import struct
from math import prod
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import normalizers
from tqdm import tqdm
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

# GGUF `general.architecture` -> Hugging Face class; the decoders the engine implements.
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.bias` -> `model.layers.3.self_attn.q_proj.bias`. Anything unknown is an error,
    not a silently dropped tensor (e.g. Llama 3's `rope_freqs`, which this engine does not model)."""
    base, kind = gguf_name.rsplit(".", 1)
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a llama/qwen2/qwen3 decoder")


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama's q/k rows: within each head, Hugging
    Face keeps the two rotary halves apart (rows i and i + d/2 rotate together); GGML's RoPE wants
    the pair adjacent (rows 2i, 2i+1). Kept here for tests that write GGUFs the way llama.cpp does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute`: adjacent rotary pairs back to split halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    # GGUF stores floats as float32; print the shortest decimal that round-trips (1e-05, not 9.99999974e-06).
    return float(str(np.float32(x)))


def hf_config(reader: GGUFReader) -> dict:
    """config.json from GGUF metadata, with the keys the engine and transformers read."""
    arch = _meta(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; expected one of {sorted(ARCHS)}")
    key = lambda name, default=None: _meta(reader, f"{arch}.{name}", default)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    scaling = key("rope.scaling.type")
    rope_scaling = None
    if scaling not in (None, "none"):
        rope_scaling = {"rope_type": scaling, "factor": _f32(key("rope.scaling.factor"))}
        if (n := key("rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = n
    return {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGUF shape is [hidden, vocab]
        "max_position_embeddings": key("context_length"),
        # No `output` tensor means the logits reuse the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _stop_ids(reader),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _stop_ids(reader: GGUFReader) -> list[int]:
    """The file's eos (<|im_end|> for ChatML instruct models), then <|endoftext|> when it is a
    different token: a chat model ends its turn with the first, raw text ends with the second."""
    ids = [_meta(reader, "tokenizer.ggml.eos_token_id")]
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is not None:
        tokens = field.contents()
        if "<|endoftext|>" in tokens and tokens.index("<|endoftext|>") not in ids:
            ids.append(tokens.index("<|endoftext|>"))
    return [i for i in ids if i is not None]


def write_tokenizer(gguf_path: Path, out: Path, config: dict) -> None:
    """tokenizer.json and tokenizer_config.json, built by transformers' GGUF tokenizer converter."""
    arch, vocab, tok_config = get_gguf_tokenizer(str(gguf_path))
    tokenizer, _ = convert_gguf_tokenizer(arch, vocab)
    if vocab.get("pre_tokenizer_type") == "qwen2":
        tokenizer.normalizer = normalizers.NFC()  # as in Qwen's own tokenizer.json
    # Control tokens (<|im_start|>, <|im_end|>, <|endoftext|>, ...) must stay whole: a chat prompt
    # that splits them into pieces runs, but the model never sees its turn markers.
    for i, (token, kind) in enumerate(zip(vocab["tokens"], vocab.get("token_type") or ())):
        if kind == 3 and tokenizer.encode(token).ids != [i]:  # 3: CONTROL
            raise ValueError(f"special token {token!r} does not encode to its own id {i}")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # load tokenizer.json as is
        "bos_token": tok_config.get("bos_token"),
        "eos_token": tok_config.get("eos_token"),
        "pad_token": tok_config.get("pad_token"),
        "unk_token": tok_config.get("unk_token"),
        "add_bos_token": tok_config.get("add_bos_token", False),
        "add_eos_token": tok_config.get("add_eos_token", False),
        "chat_template": tok_config.get("chat_template"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))


BLOCKS = "gguf/blocks.safetensors"      # in a converted folder; a subfolder, so no *.safetensors glob reads it


def read_gguf(gguf_path: Path) -> GGUFReader:
    """The file's reader; a file that is not a GGUF, or is cut short, is an error naming it."""
    try:
        return GGUFReader(gguf_path)
    except (ValueError, IndexError, EOFError, OSError) as e:
        size = gguf_path.stat().st_size if gguf_path.exists() else 0
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({size:,} bytes; corrupt or truncated?): {e}") from e


def block_tensors(reader: GGUFReader) -> list:
    """The quantized 2-D tensors, in the file's order: all of them are kept as stored, and the
    engine decides which types its kernels read (engine/quantize.py)."""
    return [t for t in reader.tensors if t.tensor_type.name not in ("F32", "F16", "BF16") and len(t.shape) == 2]


def convert_gguf(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Write a Hugging Face folder for `gguf_path` into the existing folder `out`."""
    reader = read_gguf(gguf_path)
    config = hf_config(reader)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def rows(tensor, w: np.ndarray) -> np.ndarray:
        # Llama's q/k rows are reordered by llama.cpp's converter; a row holds whole blocks, so
        # the same reordering applies to float rows and to rows of stored blocks.
        part = tensor.name.split(".")[-2]
        return unpermute(w, heads[part]) if config["model_type"] == "llama" and part in heads else w

    def load(tensor) -> np.ndarray:
        w = dequantize(tensor.data, tensor.tensor_type)
        return rows(tensor, w.reshape([int(d) for d in reversed(tensor.shape)]))

    def load_blocks(tensor) -> np.ndarray:
        return rows(tensor, np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1))

    tensors = [(hf_name(t.name), "F32", [int(d) for d in reversed(t.shape)], t) for t in reader.tensors]
    _write_safetensors(out / "model.safetensors", tensors, load, progress)
    kept = block_tensors(reader)
    (out / BLOCKS).parent.mkdir(exist_ok=True)
    blocks = [(hf_name(t.name), "U8", [int(t.shape[1]), int(t.data.shape[-1])], t) for t in kept]
    _write_safetensors(out / BLOCKS, blocks, load_blocks, progress,
                       {hf_name(t.name): t.tensor_type.name for t in kept})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(gguf_path, out, config)


_NUMPY = {"F32": "<f4", "U8": "u1"}


def _write_safetensors(path: Path, tensors: list, load, progress: bool, metadata: dict | None = None) -> None:
    """Stream (name, dtype, shape, tensor) into one safetensors file, loading one at a time: the
    1.5B model is ~7 GB in float32, and safetensors' own writer wants every tensor in memory at
    once. Format: u64 little-endian header size, JSON header (names, shapes, byte ranges), raw data."""
    header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
    for name, dtype, shape, _ in tensors:
        size = np.dtype(_NUMPY[dtype]).itemsize * prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data must start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dtype, shape, tensor in tqdm(tensors, desc=f"writing {path.name}", unit="tensor",
                                               disable=not progress):
            w = np.ascontiguousarray(load(tensor), dtype=_NUMPY[dtype])
            assert list(w.shape) == shape, (name, w.shape, shape)
            f.write(w.data)
