"""The server's configuration (one optional TOML file) and the TOML reading it shares with
tenant files: a bad file is reported as "<file>: field '<name>': <what was expected>"."""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import msgspec

from engine import EngineConfig, ModelEntry, SpecConfig
from gateway.errors import explain
from pipeline.prices import Price, default_prices

T = TypeVar("T")
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and the field."""


# The default memory budget (weights plus KV cache, all reserved at start-up) is this share of
# the memory available then: the rest is for the embedder, the OS and a process beside the
# server (an eval run, a second server).
MEMORY_SHARE = 0.4


def available_memory_gb(meminfo: Path = Path("/proc/meminfo")) -> float:
    """GiB a new process can take without swapping (Linux's MemAvailable); without /proc,
    the machine's physical memory."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20        # kB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def default_memory_budget_gb() -> float:
    return round(MEMORY_SHARE * available_memory_gb(), 1)


def default_engine() -> EngineConfig:
    # The small model drafts for the large one: greedy answers are the large model's own.
    # Weights: the device's default, chosen where the engine loads (engine.default_quant says why:
    # gguf on the CPU, int8 on a GPU).
    return EngineConfig(models={"small": ModelEntry("qwen2.5-coder-0.5b", quant="auto"),
                                "large": ModelEntry("qwen2.5-coder-1.5b", quant="auto")},
                        memory_budget_gb=default_memory_budget_gb(),
                        speculative=SpecConfig(target="large", draft="small"))


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """mode=auto through the router. Without `path` no classifier routes (tenant default) and
    escalation uses the stated uncalibrated confidence rule."""
    path: str | None = None              # router.joblib from `sluice train-router RUN`


class ReplicaConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """`sluice serve --ray`: replicas on Ray Serve, each with its own engine (docs/scale.md)."""
    min: Positive = 1
    max: Positive = 1
    # The autoscaler adds replicas while each has more requests than this (queued or running).
    target_ongoing: Positive = 16
    gpus: Annotated[float, msgspec.Meta(ge=0)] = 0.0     # per replica; 0 on CPU machines
    cpus: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # affinity: a request goes to the replica that last served its prefix unless that one has
    # `affinity_slack` more requests than the least loaded; round_robin ignores prefixes.
    routing: Literal["affinity", "round_robin"] = "affinity"
    affinity_slack: NonNegative = 4
    ingress_replicas: Positive = 1       # the light front that reads requests and routes them


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    engine: EngineConfig = msgspec.field(default_factory=default_engine)
    prices: dict[str, Price] = msgspec.field(default_factory=default_prices)
    # The bounded queue in front of the engine: this many generations run at once (the
    # engine batches them), this many more wait; past that the gateway answers 503.
    max_inflight: Positive = 32
    max_queued: NonNegative = 64
    # Seconds a request may take from arrival to its last token, unless its tenant file says
    # otherwise: past it the request is cut (504, or an SSE error event) and its row says
    # "timeout"; one that the queue's pace says cannot make it is refused at once (503).
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    # On SIGTERM (or the first Ctrl-C) the server drains: new requests get 503, those admitted
    # may finish for this long, then the rest are cut (503 shutting_down) and it exits.
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # A cheap guard before tokenizing: characters in a question, or in all chat messages.
    max_input_chars: Positive = 16_000
    # Absent: mode=auto is the tenant's default model, with no escalation (no router installed).
    router: RouterConfig | None = None
    retrieval_k: Positive = 8           # chunks searched for; trimming keeps what fits the budget
    tenant_reload_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # WAL with NORMAL survives any crash of the process (a committed row is in the WAL);
    # FULL also survives power loss, at one fsync per commit (about 5 ms on this disk).
    ledger_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    # Where the usage ledger lives: SQLite for one process (a path under the data folder, or
    # sqlite:////absolute), or PostgreSQL that every replica shares (docs/scale.md).
    ledger: Annotated[str, msgspec.Meta(pattern=r"^(sqlite:///.+|postgres(ql)?://.*)$")] = "sqlite:///ledger.sqlite"
    # Rate limits and in-flight spend: this process's memory, or Redis that replicas share.
    limits: Annotated[str, msgspec.Meta(pattern=r"^(memory|rediss?://.*|unix://.+)$")] = "memory"
    max_body_bytes: Positive = 8 * 2**20
    # Where the answer cache keeps answers: "memory" (this process, at most answer_cache_bytes,
    # least recently used out first), a Redis URL that replicas share, or "limits": the `limits`
    # Redis when there is one, else memory. Tenants turn the cache on in their files.
    answer_cache: Annotated[str, msgspec.Meta(pattern=r"^(memory|limits|rediss?://.*|unix://.+)$")] = "limits"
    answer_cache_bytes: Positive = 256 * 2**20
    # A file upload's whole body (all its files); each file is held to its tenant's max_file_bytes.
    max_upload_bytes: Positive = 64 * 2**20
    replicas: ReplicaConfig = ReplicaConfig()
    # The operator's view (/dashboard, /v1/admin/*): sha256 of the keys that open it, never a
    # tenant's. Empty: the view is closed to everyone (401).
    operator_key_sha256: list[Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]] = []

    def __post_init__(self) -> None:
        if self.replicas.min > self.replicas.max:
            raise ValueError(f"field 'replicas': min ({self.replicas.min}) is more than max ({self.replicas.max})")
        missing = sorted(set(self.engine.models) - set(self.prices))
        if missing:
            raise ValueError(f"field 'prices': no price for model(s) {', '.join(missing)}; "
                             f"every model under [engine.models] needs one")


def load_toml(path: Path, kind: type[T], defaults: dict | None = None) -> T:
    """Read and validate one TOML file into `kind`, or raise ConfigError naming file and field.
    `defaults` fills tables the file has but leaves a key out of: {"engine": {...}}."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for table, values in (defaults or {}).items():
        if isinstance(data.get(table), dict):
            data[table] = values | data[table]
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {explain(e)[1]}") from None


def load_server_config(path: str | Path | None) -> ServerConfig:
    """An [engine] table without memory_budget_gb gets the default from the memory available,
    as a server with no config does (not EngineConfig's fixed one)."""
    if path is None:
        return ServerConfig()
    return load_toml(Path(path), ServerConfig, {"engine": {"memory_budget_gb": default_memory_budget_gb()}})
