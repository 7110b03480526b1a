import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

TINY_VOCAB = 128


# ---- the compiled CPU kernels: built once before any test, and a build that fails fails the run ----

def pytest_sessionstart(session):
    """Build (or load from the cache) every compiled CPU kernel, so that the header can say which
    build runs and a broken one stops the run before any test could skip over it."""
    from kernels import decoder_cpu, gguf_cpu, layer_cpu, quant_matmul_cpu
    quant_matmul_cpu.load(), layer_cpu.load(), decoder_cpu.load(), gguf_cpu.load()


def _cpu_kernels_line() -> str:
    from kernels import cpu_build
    reason = cpu_build.unable()
    if reason:
        return f"compiled CPU kernels: none ({reason}); the PyTorch twins serve and their tests skip"
    return "compiled CPU kernels: " + ", ".join(f"{b.name} {'FAILED to build' if b.error else 'built'} for {b.isa}"
                                                for b in cpu_build.BUILDS.values())


def pytest_report_header(config):
    return _cpu_kernels_line()


def pytest_terminal_summary(terminalreporter):
    if terminalreporter.verbosity < 0:          # -q (make test) shows no header: say it here
        terminalreporter.write_line(_cpu_kernels_line())


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    """On a host with AVX2 and a C++ compiler, a kernel that does not build is an error in its
    source: the run fails here, naming it and the compiler's message, rather than every test of
    it skipping as on a host without them."""
    from kernels import cpu_build
    failed = [b for b in cpu_build.BUILDS.values() if b.error]
    if failed and cpu_build.unable() is None:
        pytest.exit("\n".join(f"the compiled CPU kernel {b.name} ({', '.join(b.sources)}, {b.isa}) failed to build "
                              f"on a host that can build it:\n{b.error}" for b in failed),
                    returncode=pytest.ExitCode.TESTS_FAILED)


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer ("t0".."tN", "<eos>") so tiny models can take text prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<eos>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tok.add_special_tokens(["<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def make_tiny_model(folder: Path, arch: str, seed: int = 0, tie: bool = False, **overrides) -> Path:
    """A random-weight transformers model of the given architecture, saved as safetensors."""
    import transformers
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=tie, eos_token_id=TINY_VOCAB - 1, bos_token_id=0)
    if arch == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float32)
    # Bigger-than-init weights give peaked logits, so greedy choices are far from ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, TINY_VOCAB)
    return folder


def quantized(w: torch.Tensor, mode: str, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A float weight [N, K] in the stored int8 or int4 format (QuantLinear's tensors), and
    those weights dequantized back to float: what a quantized layer should compute with."""
    from engine.quantize import quantize_int4, quantize_int8, unpack_int4
    if mode == "int8":
        q, s = quantize_int8(w)
        return {"w": q, "scales": s}, q.float() * s[:, None]
    n, k = w.shape
    q, s, z = quantize_int4(w, group)
    deq = (unpack_int4(q).float().view(n, k // group, group) - z[..., None]) * s[..., None]
    return {"w": q, "scales": s, "zeros": z}, deq.view(n, k)


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_folder(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
