"""Shared pieces of the gateway tests (imported by test_gateway*.py; it holds no tests).

Two tiny random Qwen2 models play "small" and "large"; they never emit EOS, so every
answer runs to its max_output_tokens and token counts are exact. The engine and the real
all-MiniLM embedder are loaded once per process and shared by every gateway a test builds;
each test gets its own tenants folder, data folder (ledger, collections) and gateway.
"""
from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from gateway.config import Price, ServerConfig
from gateway.http.app import create_app
from gateway.service import Gateway
from gateway.tenants import TenantRegistry
from tests.conftest import make_tiny_model

KEYS = {"alpha": "sk-test-alpha", "beta": "sk-test-beta"}
PRICES = {"small": Price(input=1000.0, cached_input=250.0, output=2000.0),   # $0.001 a prompt token
          "large": Price(input=3000.0, cached_input=750.0, output=6000.0)}
_shared: dict = {}


def tenant_toml(key: str, *, rpm: int = 10_000, tpm: int = 10_000_000, cap: float = 1000.0, context: int = 400,
                output: int = 32, allowed=("small", "large"), default: str = "small", salt: str | None = None,
                thinking: int = 0, selection: bool | None = None) -> str:
    """`selection`: the tenant's passage_selection; None: the default (on)."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"""
api_key_sha256 = ["{digest}"]
allowed_models = [{", ".join(f'"{m}"' for m in allowed)}]
default_model = "{default}"
context_budget = {context}
output_budget = {output}
{"" if selection is None else f"passage_selection = {str(selection).lower()}"}
prefix_cache_salt = "{salt or 'salt-' + key}"
{f"[thinking_budget]{chr(10)}hard = {thinking}{chr(10)}" if thinking else ""}
[limits]
requests_per_minute = {rpm}
tokens_per_minute = {tpm}
monthly_spend_cap_usd = {cap}
"""


def _no_eos(folder: Path) -> Path:
    """Zero the EOS row of the output head: its logit is then 0 while the best of 127 random
    logits is far above, so greedy decoding never ends early."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    weights["lm_head.weight"][-1] = 0.0
    save_file(weights, path, metadata={"format": "pt"})
    return folder


def engine_config(tmp_path_factory) -> EngineConfig:
    if "config" not in _shared:
        small = _no_eos(make_tiny_model(tmp_path_factory.mktemp("small"), "qwen2", seed=1))
        large = _no_eos(make_tiny_model(tmp_path_factory.mktemp("large"), "qwen2", seed=2))
        _shared["config"] = EngineConfig(models={"small": ModelEntry(str(small)), "large": ModelEntry(str(large))},
                                         block_size=16, max_kv_blocks=2048, memory_budget_gb=1.0)
    return _shared["config"]


@pytest.fixture
def llm(tmp_path_factory) -> LLMEngine:
    if "llm" not in _shared:
        _shared["llm"] = LLMEngine(engine_config(tmp_path_factory), progress=False)
    engine = _shared["llm"]
    yield engine
    # Whatever a test did, nothing may be left running and no KV block may leak.
    for _ in range(200):
        stats = engine.stats()
        if not engine.requests and all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in stats.values()):
            break
        time.sleep(0.01)
    assert not engine.requests, f"requests left in the engine: {list(engine.requests)}"
    assert all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in engine.stats().values()), engine.stats()


@pytest.fixture
def embedder():
    if "embedder" not in _shared:
        from retrieval import Embedder
        _shared["embedder"] = Embedder(device="cpu")
    return _shared["embedder"]


@pytest.fixture
def slow_llm(llm, monkeypatch):
    """The engine, 3 ms slower a step: a 400-token answer then takes over a second, so a
    client can be sure to leave while it is being generated, however loaded the machine."""
    step = llm.step
    monkeypatch.setattr(llm, "step", lambda: (time.sleep(0.003), step())[1])
    return llm


def make_gateway(root: Path, llm: LLMEngine, embedder, tenants: dict[str, str] | None = None,
                 **config) -> Gateway:
    (root / "tenants").mkdir(parents=True, exist_ok=True)
    for name, text in (tenants or {n: tenant_toml(k) for n, k in KEYS.items()}).items():
        (root / "tenants" / f"{name}.toml").write_text(text)
    cfg = ServerConfig(engine=llm.config, prices=PRICES, **{"tenant_reload_interval_s": 0.0, **config})
    registry = TenantRegistry(root / "tenants", set(cfg.engine.models), cfg.tenant_reload_interval_s)
    return Gateway(cfg, registry, root / "data", engine=llm, embedder=embedder)


def auth(tenant: str = "alpha") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


DOCS = {"documents": [
    {"id": "paris", "title": "Paris", "text": "Paris is the capital of France. The Eiffel Tower stands in Paris."},
    {"id": "berlin", "title": "Berlin", "text": "Berlin is the capital of Germany. The Brandenburg Gate is there."},
    {"id": "rome", "title": "Rome", "text": "Rome is the capital of Italy. The Colosseum is in Rome."}]}


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event, data) per frame; checks the framing: frames end with a blank line, every
    line is `event: ...` or `data: ...`."""
    assert text.endswith("\n\n"), "an SSE stream ends with a blank line"
    frames = []
    for frame in text[:-2].split("\n\n"):
        event, data = None, []
        for line in frame.split("\n"):
            field, sep, value = line.partition(": ")
            assert sep and field in ("event", "data"), f"bad SSE line {line!r}"
            if field == "event":
                event = value
            else:
                data.append(value)
        frames.append((event, "\n".join(data)))
    return frames


class Server:
    """A real uvicorn server on 127.0.0.1 in a thread of its own, with its own event loop."""

    def __init__(self, gateway: Gateway):
        import uvicorn

        from gateway.http.server import DrainingServer
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = DrainingServer(uvicorn.Config(create_app(gateway), log_level="warning", lifespan="on"), gateway)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        import httpx
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the server did not become ready")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def wait_ready(client, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "gateway not ready"
        time.sleep(0.02)
