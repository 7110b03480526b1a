"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand: a
counter, a gauge read at scrape time, and a histogram are all this gateway needs."""
from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds; from a cache hit on a tiny model to a long CPU answer.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Labels, values: Labels, extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if v != int(v) else str(int(v))


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Labels = ()):
        self.name, self.help, self.label_names = name, help, labels

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> Iterable[str]:
        raise NotImplementedError

    def render(self) -> list[str]:
        return self.header() + list(self.samples())


class Counter(Metric):
    kind = "counter"

    def __init__(self, name, help, labels=()):
        super().__init__(name, help, labels)
        self.values: dict[Labels, float] = defaultdict(float)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] += amount

    def samples(self):
        for labels, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.label_names, labels)} {_number(v)}"


class Sampled(Metric):
    """A gauge or counter whose values are read from elsewhere (the engine, the tenants) at scrape time."""

    def __init__(self, name, help, labels, read: Callable[[], dict[Labels, float]], kind: str = "gauge"):
        super().__init__(name, help, labels)
        self.read, self.kind = read, kind

    def samples(self):
        for labels, v in sorted(self.read().items()):
            yield f"{self.name}{_labels(self.label_names, labels)} {_number(v)}"


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name, help, labels=(), buckets=LATENCY_BUCKETS):
        super().__init__(name, help, labels)
        self.buckets = tuple(buckets)
        self.series: dict[Labels, list] = {}     # labels -> [counts per bucket..., sum, count]

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0] * len(self.buckets) + [0.0, 0]
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[i] += 1
        s[-2] += value
        s[-1] += 1

    def samples(self):
        for labels, s in sorted(self.series.items()):
            running = 0
            for bound, n in zip(self.buckets, s):
                running += n
                yield self._bucket(labels, _number(bound), running)
            yield self._bucket(labels, "+Inf", s[-1])
            yield f"{self.name}_sum{_labels(self.label_names, labels)} {_number(s[-2])}"
            yield f"{self.name}_count{_labels(self.label_names, labels)} {s[-1]}"

    def _bucket(self, labels: Labels, le: str, n: int) -> str:
        bound = f'le="{le}"'
        return f"{self.name}_bucket{_labels(self.label_names, labels, bound)} {n}"


class Registry:
    def __init__(self):
        self.metrics: list[Metric] = []

    def add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


class GatewayMetrics:
    """The gateway's metric families. What lives elsewhere (engine queues and cache, the
    bounded queue, tenant files) is read through callables at scrape time."""

    def __init__(self, engine_stats: Callable[[], dict[str, dict]], queue: Callable[[], tuple[int, int]],
                 tenant_state: Callable[[], tuple[int, dict[str, str], dict[str, int]]]):
        r = self.registry = Registry()
        self.http = r.add(Counter("sluice_http_requests_total", "HTTP requests by route, status code and tenant",
                                  ("route", "code", "tenant")))
        self.http_latency = r.add(Histogram("sluice_http_request_duration_seconds",
                                            "HTTP request latency, to the last byte", ("route",)))
        self.answers = r.add(Counter("sluice_answers_total", "requests that reached the engine, by outcome",
                                     ("model", "status")))
        self.tokens = r.add(Counter("sluice_tokens_total", "tokens by tenant, model and kind "
                                    "(prompt includes cached)", ("tenant", "model", "kind")))
        self.cost = r.add(Counter("sluice_cost_usd_total", "spend in US dollars", ("tenant", "model")))
        self.evicted_tokens = r.add(Counter("sluice_kv_evicted_tokens_total", "tokens of conversations over the "
                                            "context budget that a KV window dropped (long_context = window)",
                                            ("tenant", "model")))
        self.escalations = r.add(Counter("sluice_escalations_total", "answers escalated to the large model"))
        self.early_escalations = r.add(Counter("sluice_early_escalations_total", "escalations decided on the "
                                               "first answer's first tokens, cutting it short"))
        self.widened = r.add(Counter("sluice_widened_total", "escalations of a narrow arm's answer to the same "
                                     "model with a wider context"))
        self.passages = r.add(Counter("sluice_context_passages_total", "passages put in prompts, whole or cut to "
                                      "what bears on the question (passage_selection)", ("tenant", "kind")))
        self.routes = r.add(Counter("sluice_route_decisions_total", "first-call routes by tenant, model, difficulty "
                                    "and what chose them (client, no_router, classifier, policy, fallback)",
                                    ("tenant", "model", "difficulty", "source")))
        self.arms = r.add(Counter("sluice_arm_answers_total", "answers by tenant and the router's arm (not routed "
                                  "by arms: the answering model)", ("tenant", "arm")))
        r.add(Sampled("sluice_escalation_rate", "escalated answers over all answers", (),
                      lambda: {(): self.escalations.values.get((), 0.0) / max(1.0, sum(self.answers.values.values()))}))
        self.latency = r.add(Histogram("sluice_request_seconds", "ask latency, arrival to last token", ("model",)))
        self.ttft = r.add(Histogram("sluice_ttft_seconds", "arrival to first token", ("model",)))
        self.queue_wait = r.add(Histogram("sluice_queue_seconds", "wait in the bounded queue", ("model",)))
        self.retrieval = r.add(Histogram("sluice_retrieval_seconds", "search and trimming", ()))
        self.ingested = r.add(Counter("sluice_ingested_documents_total", "documents ingested, by tenant and outcome "
                                      "(added, replaced, unchanged: skipped as stored)", ("tenant", "outcome")))
        self.embedded = r.add(Counter("sluice_embedded_chunks_total", "chunks embedded on ingest", ("tenant",)))
        r.add(Sampled("sluice_queue_depth", "requests waiting for an engine slot", (), lambda: {(): queue()[1]}))
        r.add(Sampled("sluice_inflight", "requests holding an engine slot", (), lambda: {(): queue()[0]}))
        for key, name, help, kind in [
                ("running", "sluice_engine_running", "sequences the engine is running", "gauge"),
                ("waiting", "sluice_engine_waiting", "sequences waiting inside the engine", "gauge"),
                ("kv_blocks_free", "sluice_kv_blocks_free", "free KV blocks", "gauge"),
                ("kv_blocks_total", "sluice_kv_blocks_total", "KV blocks", "gauge"),
                ("prefix_cache_queries", "sluice_prefix_cache_queries_total", "full blocks looked up", "counter"),
                ("prefix_cache_hits", "sluice_prefix_cache_hits_total", "full blocks found cached", "counter"),
                ("preemptions", "sluice_preemptions_total", "sequences preempted for KV space", "counter"),
                ("scheduled_ahead", "sluice_engine_scheduled_ahead_total",
                 "sequences planned while their step before ran (async scheduling)", "counter"),
                ("discarded_outputs", "sluice_engine_discarded_outputs_total",
                 "step outputs dropped as their sequence had finished meanwhile (async scheduling)", "counter"),
                ("thinking_probes", "sluice_thinking_probes_total",
                 "early exit's probes: looks at the answer while a request thinks", "counter"),
                ("thinking_probe_tokens", "sluice_thinking_probe_tokens_total",
                 "tokens those probes cost (billed as output)", "counter"),
                ("thinking_early_exits", "sluice_thinking_early_exits_total",
                 "thinking spans closed early, their answer settled", "counter")]:
            r.add(Sampled(name, help, ("model",), lambda key=key: {(m, ): s[key] for m, s in engine_stats().items()},
                          kind))
        r.add(Sampled("sluice_prefix_cache_hit_rate", "prefix cache hits over lookups", ("model",),
                      lambda: {(m,): s["prefix_cache_hits"] / max(1, s["prefix_cache_queries"])
                               for m, s in engine_stats().items()}))
        # Where each model runs, and the kernels that fell back to their PyTorch twins there.
        r.add(Sampled("sluice_engine_device", "1 for the device each model runs on", ("model", "device"),
                      lambda: {(m, s["device"]): 1 for m, s in engine_stats().items()}))
        r.add(Sampled("sluice_engine_cuda_graphs", "decode batch sizes captured as CUDA graphs", ("model",),
                      lambda: {(m,): len(s["cuda_graph_batch_sizes"]) for m, s in engine_stats().items()}))
        r.add(Sampled("sluice_engine_weight_bytes", "bytes of each model's weights as loaded, by precision "
                      "(ModelEntry.quant)", ("model", "quant"),
                      lambda: {(m, s["quant"]): s["weight_bytes"] for m, s in engine_stats().items()}))
        r.add(Sampled("sluice_engine_dequant_rows", "rows from which quantized matmuls dequantize to float32 "
                      "(0: never)", ("model",), lambda: {(m,): s["dequant_rows"] for m, s in engine_stats().items()}))
        r.add(Sampled("sluice_engine_dense_buckets", "decode batch sizes whose quantized matmuls run on a dense "
                      "dequantized copy, per the device's measured bucket table (ModelEntry.dense_buckets)", ("model",),
                      lambda: {(m,): len(s["dense_buckets"]) for m, s in engine_stats().items()}))
        r.add(Sampled("sluice_engine_gemv_buckets", "decode batch sizes whose bf16 layers of a kind (qkv, o, ...), "
                      "or a quantized model's layers (int8, fp8), run the Triton GEMV, per the device's "
                      "measured bucket table "
                      "(ModelEntry.dense_buckets)", ("model", "layer"),
                      lambda: {(m, kind): len(b) for m, s in engine_stats().items()
                               for kind, b in s["gemv_buckets"].items()}))
        r.add(Sampled("sluice_engine_gguf_steps", "a K-quant's activation steps per block of 256 on the gguf "
                      "precision's CPU kernel: 1, one int8 scale (llama.cpp's q8_K); up to 8, a step per 32 values "
                      "(ModelEntry.gguf_steps)", ("model",),
                      lambda: {(m,): s["gguf_steps"] for m, s in engine_stats().items() if s["quant"] == "gguf"}))
        r.add(Sampled("sluice_engine_dot_rows", "rows from which quantized matmuls run on integer dot products on "
                      "the CPU (0: never)", ("model",),
                      lambda: {(m,): s["dot_rows"] for m, s in engine_stats().items()}))
        r.add(Sampled("sluice_engine_dot_vnni", "1 where those integer dot products run on kernels built with "
                      "AVX-512 VNNI (SLUICE_CPU_VNNI=0: the AVX2 build)", ("model",),
                      lambda: {(m,): int(s["dot_vnni"]) for m, s in engine_stats().items()}))
        r.add(Sampled("sluice_engine_cpu_kernels", "1 where a layer's norms, rotary, SiLU product and decode "
                      "attention run as compiled CPU kernels", ("model",),
                      lambda: {(m,): int(s["cpu_kernels"]) for m, s in engine_stats().items()}))
        r.add(Sampled("sluice_engine_cpu_steps_total", "decode steps run as one compiled call on the CPU "
                      "(EngineConfig.cpu_step)", ("model",),
                      lambda: {(m,): s["cpu_steps"] for m, s in engine_stats().items()}, "counter"))
        r.add(Sampled("sluice_kernel_fallback", "1 for each kernel running its PyTorch twin after failing to launch",
                      ("model", "kernel"),
                      lambda: {(m, k): 1 for m, s in engine_stats().items() for k in s["kernel_fallbacks"]}))
        # Speculative decoding, for the models that verify drafts (the engine reports no others).
        spec = lambda key: {(m,): s["speculation"][key] for m, s in engine_stats().items()
                            if s.get("speculation") and s["speculation"][key] is not None}
        r.add(Sampled("sluice_spec_proposed_tokens_total", "draft tokens proposed for verification", ("model",),
                      lambda: spec("proposed"), "counter"))
        r.add(Sampled("sluice_spec_accepted_tokens_total", "draft tokens the target accepted", ("model",),
                      lambda: spec("accepted"), "counter"))
        r.add(Sampled("sluice_spec_acceptance_rate", "accepted over proposed draft tokens", ("model",),
                      lambda: spec("acceptance_rate")))
        r.add(Sampled("sluice_spec_draft_seconds_total", "seconds spent drafting (draft model and prompt lookup)",
                      ("model",), lambda: spec("draft_seconds"), "counter"))
        r.add(Sampled("sluice_spec_tokens_per_verify_pass", "tokens a verification pass gains, accepted plus one",
                      ("model",), lambda: spec("tokens_per_verify_pass")))
        r.add(Sampled("sluice_spec_draft_vocab", "token ids the draft model may propose (its head's rows)",
                      ("model",), lambda: spec("draft_vocab")))
        governor = lambda: {m: s["speculation"]["governor"] for m, s in engine_stats().items()
                            if s.get("speculation") and s["speculation"].get("governor")}
        r.add(Sampled("sluice_spec_governor_arm", "1 for the drafting arm the governor runs, by batch-size bucket "
                      "(plain, lookup, model, lookup+model)", ("model", "batch", "arm"),
                      lambda: {(m, b, v["arm"]): 1 for m, g in governor().items() for b, v in g.items() if v["arm"]}))
        r.add(Sampled("sluice_spec_governor_goodput", "decode tokens per second the governor measured per arm",
                      ("model", "batch", "arm"),
                      lambda: {(m, b, arm): rate for m, g in governor().items() for b, v in g.items()
                               for arm, rate in v["tok_s"].items()}))
        r.add(Sampled("sluice_spec_governor_probe_period", "steps between re-tries of the arms not in use",
                      ("model", "batch"), lambda: {(m, b): v["probe_period"] for m, g in governor().items()
                                                   for b, v in g.items()}))
        r.add(Sampled("sluice_tenants_loaded", "tenants with a usable file", (), lambda: {(): tenant_state()[0]}))
        r.add(Sampled("sluice_tenant_file_error", "1 for each tenant file whose current content is refused",
                      ("file",), lambda: {(f,): 1 for f in tenant_state()[1]}))
        r.add(Sampled("sluice_tenant_reloads_total", "tenant file reads by result", ("result",),
                      lambda: {(k,): v for k, v in tenant_state()[2].items()}, "counter"))

        # The ledger's folds into the operator view's running totals (gateway/usage/rollup.py),
        # after each commit: (rows folded, folds failed) by this process.
        self.ledger_state: Callable[[], tuple[int, int]] = lambda: (0, 0)
        r.add(Sampled("sluice_ledger_folded_rows_total", "ledger rows folded into the operator view's running "
                      "totals", (), lambda: {(): self.ledger_state()[0]}, "counter"))
        r.add(Sampled("sluice_ledger_fold_failures_total", "folds into the running totals that failed (their rows "
                      "are folded by a later one)", (), lambda: {(): self.ledger_state()[1]}, "counter"))

        # The answer cache (pipeline/answer_cache.py); `answer_cache_state` is set once the
        # pipeline is built: (its store's {"bytes", "entries"} where it can say, store failures).
        self.answer_cache_state: Callable[[], tuple[dict[str, int], int]] = lambda: ({}, 0)
        self.answer_cache = r.add(Counter("sluice_answer_cache_lookups_total", "answer cache lookups by tenant and "
                                          "result (hit, near_hit, miss)", ("tenant", "result")))
        self.answer_cache_stored = r.add(Counter("sluice_answer_cache_stored_total", "finished answers filed in the "
                                                 "answer cache", ("tenant",)))
        self.answer_cache_saved = r.add(Counter("sluice_answer_cache_saved_usd_total", "dollars hits saved: what the "
                                                "cached answers cost to make, less the hit price", ("tenant",)))
        r.add(Sampled("sluice_answer_cache_bytes", "bytes of answers the in-memory answer cache holds", (),
                      lambda: {(): v for k, v in self.answer_cache_state()[0].items() if k == "bytes"}))
        r.add(Sampled("sluice_answer_cache_entries", "entries the in-memory answer cache holds", (),
                      lambda: {(): v for k, v in self.answer_cache_state()[0].items() if k == "entries"}))
        r.add(Sampled("sluice_answer_cache_errors_total", "answer cache store failures (Redis unreachable), each "
                      "answered uncached", (), lambda: {(): self.answer_cache_state()[1]}, "counter"))

    def render(self) -> str:
        return self.registry.render()
