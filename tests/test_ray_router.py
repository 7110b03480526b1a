"""The Ray Serve pieces that need no cluster: the affinity router's choices, the ingress's
prefix keys, and how replicas' metrics merge. (tests/test_ray_serve.py runs them on Ray.)"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("ray")
from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,  # noqa: E402
)
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402

from gateway.config import Price, ServerConfig  # noqa: E402
from gateway.scale.serve_ray import merge_metrics  # noqa: E402
from gateway.scale.serve_requests import Forwarded, Pinned, PrefixKeys  # noqa: E402
from gateway.scale.serve_router import AffinityRouter  # noqa: E402
from retrieval import CollectionStore, Document  # noqa: E402
from tests.test_gateway_support import KEYS, auth, embedder, engine_config, tenant_toml  # noqa: E402,F401

DEPLOYMENT = DeploymentID(name="SluiceReplica", app_name="sluice")


@dataclass
class Replica:
    """What the router reads of a running replica."""
    replica_id: ReplicaID


def router(**kwargs) -> tuple[AffinityRouter, list[Replica]]:
    r = AffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(**kwargs)
    return r, [Replica(ReplicaID(name, DEPLOYMENT)) for name in ("a", "b", "c")]


def pending(body) -> PendingRequest:
    return PendingRequest(args=[body], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="i"),
                          future=None)             # the router under test never settles it


def ask(key: str | None) -> PendingRequest:
    return pending(Forwarded("POST", "/v1/ask", b"", [], b"{}", affinity=key))


def route(r: AffinityRouter, replicas: list[Replica], request: PendingRequest) -> str:
    """Where the request goes when its first choice accepts it; the router is told so."""
    ranks = asyncio.run(r.choose_replicas(replicas, request))
    chosen = ranks[0][0]
    r.on_request_routed(request, chosen.replica_id, None)
    return chosen.replica_id.unique_id


def test_a_prefix_stays_on_its_replica_until_that_one_is_overloaded():
    r, replicas = router(slack=3)
    home = route(r, replicas, ask("k1"))
    assert [route(r, replicas, ask("k1")) for _ in range(3)] == [home] * 3     # 4 in flight there now
    elsewhere = route(r, replicas, ask("k1"))                # 4 > 0 + 3: the least loaded takes it
    assert elsewhere != home and route(r, replicas, ask("k1")) == elsewhere   # and keeps it
    assert r.counts == {"new": 1, "affine": 4, "moved": 1}
    for _ in range(4):                                       # the first replica's requests end
        r.on_request_completed(ReplicaID(home, DEPLOYMENT), "i")
    assert r.inflight[ReplicaID(home, DEPLOYMENT)] == 0


def test_new_prefixes_spread_over_the_replicas_and_requests_without_one_go_to_the_least_loaded():
    r, replicas = router()
    homes = [route(r, replicas, ask(f"k{i}")) for i in range(6)]
    for replica in replicas:                                  # nothing in flight: spread by keys held
        r.inflight[replica.replica_id] = 0
    assert sorted(homes) == ["a", "a", "b", "b", "c", "c"]
    r.inflight[ReplicaID("a", DEPLOYMENT)] = 3
    r.inflight[ReplicaID("b", DEPLOYMENT)] = 1
    assert route(r, replicas, ask(None)) == "c" and r.counts["new"] == 6


def test_round_robin_ignores_prefixes_and_pinned_calls_reach_their_replica():
    r, replicas = router(policy="round_robin")
    assert [route(r, replicas, ask("k")) for _ in range(4)] == ["a", "b", "c", "a"]
    ranks = asyncio.run(r.choose_replicas(replicas, pending(Pinned("b"))))
    assert [[x.replica_id.unique_id for x in rank] for rank in ranks] == [["b"]]


def test_prefix_keys_follow_the_prompts_shared_prefix(tmp_path, tmp_path_factory, embedder):
    engine = engine_config(tmp_path_factory)
    (tmp_path / "tenants").mkdir()
    for name, key in KEYS.items():
        (tmp_path / "tenants" / f"{name}.toml").write_text(tenant_toml(key, context=90))
    store = CollectionStore(tmp_path / "collections", embedder)
    store.collection("alpha", "topics").ingest([Document(id=f"d{t}", title="", text=" ".join(
        f"t{t * 20 + i % 20 + 1}" for i in range(30))) for t in range(3)])
    store.close()
    keys = PrefixKeys(ServerConfig(engine=engine, prices={m: Price(1.0, 1.0, 1.0) for m in engine.models}),
                      tmp_path / "tenants", tmp_path, embedder)
    headers = lambda tenant="alpha": [(b"authorization", auth(tenant)["Authorization"].encode())]

    def key(body: bytes, tenant="alpha", path="/v1/ask") -> str | None:
        return keys.key(path, headers(tenant), body)

    topic0 = key(b'{"question": "t1 t2 t3", "collection": "topics"}')
    assert topic0 is not None and topic0 == key(b'{"question": "t4 t5", "collection": "topics"}')
    assert key(b'{"question": "t21 t22", "collection": "topics"}') not in (None, topic0)
    assert key(b'{"question": "t1 t2 t3"}') is None                      # no collection, no earlier turns
    chat = b'{"model": "auto", "messages": [{"role": "user", "content": "t1"}, {"role": "assistant", ' \
           b'"content": "t2"}, {"role": "user", "content": "%s"}]}'
    turns = key(chat % b"t3", path="/v1/chat/completions")
    assert turns is not None and turns == key(chat % b"t9", path="/v1/chat/completions")
    assert key(chat % b"t3", tenant="beta", path="/v1/chat/completions") not in (None, turns)   # salted per tenant
    assert key(b'{"question": "t1", "collection": "nope"}') is None      # the replica will say 404
    assert keys.key("/v1/ask", [], b'{"question": "t1", "collection": "topics"}') is None   # nor 401
    assert key(b'not json') is None and key(b'{}', path="/v1/collections") is None


def test_replicas_metrics_merge_into_one_family_each_labelled_by_replica():
    text = ("# HELP sluice_answers_total answers\n# TYPE sluice_answers_total counter\n"
            'sluice_answers_total{model="small",status="ok"} %d\n'
            "# HELP sluice_inflight in flight\n# TYPE sluice_inflight gauge\nsluice_inflight %d\n")
    merged = merge_metrics({"r1": text % (3, 1), "r2": text % (5, 0)})
    assert merged.splitlines() == [
        "# HELP sluice_answers_total answers", "# TYPE sluice_answers_total counter",
        'sluice_answers_total{replica="r1",model="small",status="ok"} 3',
        'sluice_answers_total{replica="r2",model="small",status="ok"} 5',
        "# HELP sluice_inflight in flight", "# TYPE sluice_inflight gauge",
        'sluice_inflight{replica="r1"} 1', 'sluice_inflight{replica="r2"} 0']
    assert all(re.match(r"^(# (HELP|TYPE) .*|\w+\{.*\} \d+)$", line) for line in merged.splitlines())


def test_the_deploy_files_load_and_build_the_application(tmp_path):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from gateway.config import ConfigError, load_server_config
    from gateway.scale.serve_ray import application, build
    root = Path(__file__).parent.parent / "deploy"
    config = load_server_config(root / "sluice.toml")
    assert config.ledger.startswith("postgresql://") and config.limits.startswith("redis://")
    assert (config.replicas.min, config.replicas.max, config.replicas.gpus) == (1, 2, 1.0)
    schema = ServeDeploySchema.parse_obj(yaml.safe_load((root / "serve.yaml").read_text()))
    [app] = schema.applications
    assert app.import_path == "gateway.scale.serve_ray:build" and set(app.args) == {"config", "tenants", "data"}
    built = build({"config": str(root / "sluice.toml"), "tenants": str(tmp_path), "data": str(tmp_path)})
    replica = built._bound_deployment.init_args[0]._bound_deployment
    assert replica._deployment_config.autoscaling_config.max_replicas == 2
    assert replica.ray_actor_options["num_gpus"] == 1.0
    assert replica._deployment_config.request_router_config.request_router_kwargs == {"policy": "affinity",
                                                                                       "slack": 4}
    compose = yaml.safe_load((root / "compose.yaml").read_text())
    assert set(compose["services"]) == {"postgres", "redis", "sluice"}
    with pytest.raises(ConfigError, match="shared ledger and limits"):
        application(msgspec.structs.replace(config, ledger="sqlite:///ledger.sqlite"), tmp_path, tmp_path)
