"""The gateway's commands under `sluice` (cli.py): serve, ingest documents, ask a question
locally through the same pipeline as /v1/ask, check tenant files, fetch models."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import msgspec

from engine import LLMEngine
from gateway.config import RouterConfig, ServerConfig
from gateway.tenants import Tenant, TenantRegistry, check_folder
from models.store import resolve

REPO = Path(__file__).resolve().parent.parent
DEMO_TENANTS = REPO / "examples" / "tenants"
DEMO_DATA = REPO / ".cache" / "demo"
DEMO_KEY = "sk-sluice-demo"          # examples/tenants/demo.toml holds its sha256
DEMO_COLLECTION = "docs"
DEMO_QUESTION = "What happens to a request when its client disconnects?"


class UsageError(Exception):
    """Bad arguments or files: printed, exit code 2."""


def _folders(args) -> tuple[Path, Path]:
    return (DEMO_TENANTS, DEMO_DATA) if args.demo else (Path(args.tenants), Path(args.data))


def _registry(args, config: ServerConfig) -> TenantRegistry:
    registry = TenantRegistry(_folders(args)[0], set(config.engine.models), config.tenant_reload_interval_s)
    for error in registry.errors.values():
        print(f"sluice: warning: {error}", file=sys.stderr)
    return registry


def _tenant(registry: TenantRegistry, tenant_id: str) -> Tenant:
    tenant = registry.get(tenant_id)
    if tenant is None:
        raise UsageError(f"no usable tenant {tenant_id!r} in {registry.folder} "
                         f"(found: {', '.join(sorted(registry.tenants)) or 'none'})")
    return tenant


def _embedder():
    from retrieval import Embedder
    print("loading the embedder...", file=sys.stderr)
    return Embedder()


# ---------------------------------------------------------------------- ingest

def _files(path: Path) -> list:
    """A file, or every file of a folder with a type Sluice reads (ids: paths within the folder)."""
    from retrieval import File
    from retrieval.files import KINDS
    if path.is_file():
        return [File(path.name, path.read_bytes())]
    if not path.is_dir():
        raise UsageError(f"{path}: no such file or folder")
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in KINDS)
    if not found:
        raise UsageError(f"{path}: holds no documents (looked for {', '.join(sorted(KINDS))})")
    return [File(str(p.relative_to(path)), p.read_bytes()) for p in found]


def ingest_paths(store, tenant_id: str, collection: str, paths: list[Path], max_file_bytes: int | None = None):
    """Ingest files and folders as POST /v1/collections/{name}/files does, with progress bars
    (files read, then chunks embedded); returns the IngestReport. Every file is read before the
    collection is touched: one bad file (exit 2, named) leaves it exactly as it was. An
    unchanged file is not even read again, so ingesting the same folder again is quick."""
    from tqdm import tqdm

    from retrieval import RetrievalError, read_changed
    files = [f for path in paths for f in _files(path)]
    try:
        stored = store.collection(tenant_id, collection, create=False).digests()
    except RetrievalError:
        stored = {}
    with tqdm(total=len(files), desc="read", unit="file", file=sys.stderr) as bar:
        docs, unchanged = read_changed(files, stored, max_file_bytes, progress=lambda f: bar.update())
    with tqdm(desc="embed", unit="chunk", file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
        return store.collection(tenant_id, collection).ingest(docs, progress, unchanged)


def cmd_ingest(args, config: ServerConfig) -> int:
    from retrieval import CollectionStore
    tenant = _tenant(_registry(args, config), args.tenant)
    store = CollectionStore(_folders(args)[1] / "collections", _embedder())
    try:
        r = ingest_paths(store, tenant.id, args.collection, [Path(args.path)], tenant.spec.limits.max_file_bytes)
    finally:
        store.close()
    print(f"{tenant.id}/{args.collection}: {r.documents} documents ({r.added} added, {r.replaced} replaced, "
          f"{r.unchanged} unchanged), {r.chunks} chunks ({r.embedded} embedded anew)")
    return 0


# ------------------------------------------------------------------------- ask

async def _ask(args, config: ServerConfig) -> int:
    from gateway.service import Done, Gateway, Meta, Token
    from pipeline import Query
    registry = _registry(args, config)
    tenant = _tenant(registry, args.tenant)
    # Load only the model that will answer (and its draft model): one local question need
    # not wait for every model the server would load. With the router installed, auto may
    # pick either model and escalate: then all of them.
    model = tenant.spec.default_model if args.mode == "auto" else args.mode
    spec = (config.engine.speculative if config.engine.speculative and config.engine.speculative.target == model
            else None)
    names = {model, *([spec.draft] if spec and spec.draft else [])}
    if args.mode == "auto" and config.router is not None:
        names, spec = set(config.engine.models), config.engine.speculative
    engine = LLMEngine(msgspec.structs.replace(config.engine, speculative=spec,
                                               models={n: config.engine.models[n] for n in names}))
    gateway = Gateway(config, registry, _folders(args)[1], engine=engine, embedder=_embedder())
    await gateway.start()
    await gateway.wait_ready()
    query = Query(question=args.question, endpoint="cli", collection=args.collection, mode=args.mode,
                  max_output_tokens=args.max_tokens)
    try:
        async for event in gateway.run(tenant, query):
            if isinstance(event, Meta):
                print(f"[{event.decision.model}: {event.decision.reason}; {event.trimmed.kept} passages]",
                      file=sys.stderr)
                citations = event.citations
            elif isinstance(event, Token):
                print(event.text, end="", flush=True)
            elif isinstance(event, Done):
                print()
                for c in citations:
                    print(f"  [{c.number}] {c.doc_id} {c.title}".rstrip(), file=sys.stderr)
                u = event.usage
                print(f"[{u.prompt} prompt tokens ({u.cached} cached), {u.completion} output tokens, "
                      f"${event.cost:.6f}, {event.timings.total / 1000:.1f} s]", file=sys.stderr)
    finally:
        await gateway.stop()
    return 0


def cmd_ask(args, config: ServerConfig) -> int:
    return asyncio.run(_ask(args, config))


# ----------------------------------------------------------------------- serve

def demo_documents() -> list[Path]:
    """The project's own docs: what `serve --demo` answers from."""
    return sorted((REPO / "docs").glob("*.md")) + [p for p in [REPO / "README.md"] if p.exists()]


def demo_banner(host: str, port: int) -> str:
    body = f'{{"question": "{DEMO_QUESTION}", "collection": "{DEMO_COLLECTION}", "max_output_tokens": 128}}'
    url = f"http://{host}:{port}"
    return (f"\nSluice is ready. Ask it about its own docs:\n\n"
            f"  curl -s {url}/v1/ask -H 'Authorization: Bearer {DEMO_KEY}' \\\n"
            f"       -H 'Content-Type: application/json' -d '{body}'\n\n"
            f"Stream it: add \"stream\": true and curl -N. OpenAPI schema: {url}/schema/openapi.json\n")


def cmd_serve(args, config: ServerConfig) -> int:
    from gateway.http.server import serve
    from gateway.service import Gateway
    from retrieval import CollectionStore
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.ray:
        from gateway.scale.serve_ray import run
        run(config, *_folders(args), args.host, args.port)
        return 0
    registry = _registry(args, config)
    _, data = _folders(args)
    engine = embedder = banner = None
    if args.demo:
        # Everything slow happens here, in front of the user, with progress bars: fetching
        # and converting the models on first use, then embedding the docs.
        _tenant(registry, "demo")
        if config.router is None:          # mode=auto through the checked-in trained router
            from router.model import TRAINED_ROUTER
            config = msgspec.structs.replace(config, router=RouterConfig(str(TRAINED_ROUTER)))
        engine = LLMEngine(config.engine)
        embedder = _embedder()
        store = CollectionStore(data / "collections", embedder)
        try:
            ingest_paths(store, "demo", DEMO_COLLECTION, demo_documents())
        finally:
            store.close()
        banner = demo_banner(args.host, args.port)
    gateway = Gateway(config, registry, data, engine=engine, embedder=embedder)
    serve(gateway, args.host, args.port, banner)
    return 0


# --------------------------------------------------------------- tenants, models

def cmd_tenants_check(args, config: ServerConfig) -> int:
    tenants, errors = check_folder(args.dir, set(config.engine.models))
    for t in tenants:
        s, lim = t.spec, t.spec.limits
        print(f"ok     {t.id}: models {'/'.join(s.allowed_models)} (default {s.default_model}), "
              f"context {s.context_budget}, output {s.output_budget} tokens, {lim.requests_per_minute} req/min, "
              f"{lim.tokens_per_minute} tokens/min, cap ${lim.monthly_spend_cap_usd:.2f}/month, "
              f"{len(s.api_key_sha256)} key(s){_answer_cache(s.answer_cache)}")
    for error in errors.values():
        print(f"error  {error}", file=sys.stderr)
    if not tenants and not errors:
        raise UsageError(f"{args.dir}: no tenant files (*.toml)")
    return 2 if errors else 0


def _answer_cache(c) -> str:
    if not c.enabled:
        return ""
    near = f", near duplicates at similarity {c.similarity:g}" if c.near_duplicates else ""
    return f", answer cache {c.ttl_s:g} s{near}"


def cmd_models_fetch(args, config: ServerConfig) -> int:
    for name, entry in config.engine.models.items():
        print(f"{name}: {resolve(entry.source, progress=True)}")
    return 0


# -------------------------------------------------------------------- commands

def add_commands(sub) -> None:
    """The gateway's subcommands, onto the `sluice` parser's subparsers."""
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--tenants", default="tenants", metavar="DIR",
                       help="folder of tenant files (default: %(default)s)")
    where.add_argument("--data", default="sluice-data", metavar="DIR",
                       help="collections and usage ledger (default: %(default)s)")
    where.add_argument("--demo", action="store_true",
                       help=f"use the demo tenant ({DEMO_TENANTS.relative_to(REPO)}) "
                            f"and data ({DEMO_DATA.relative_to(REPO)})")

    serve = sub.add_parser("serve", parents=[where], help="run the HTTP gateway")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--ray", action="store_true", help="serve as replicas on Ray Serve, as the config's [replicas] "
                                                          "says (docs/scale.md); collections are ingested beforehand")
    serve.set_defaults(run=cmd_serve)
    serve.epilog = "With --demo: fetch the models, ingest docs/*.md and README.md as collection 'docs', serve."

    ingest = sub.add_parser("ingest", parents=[where], help="add files (or a folder) to a tenant's collection")
    ingest.add_argument("path")
    ingest.add_argument("--collection", required=True)
    ingest.add_argument("--tenant", required=True)
    ingest.set_defaults(run=cmd_ingest)

    ask = sub.add_parser("ask", parents=[where], help="answer one question here, through the /v1/ask pipeline")
    ask.add_argument("question")
    ask.add_argument("--tenant", default="demo")
    ask.add_argument("--collection")
    ask.add_argument("--mode", choices=["auto", "small", "large"], default="auto")
    ask.add_argument("--max-tokens", type=int, help="output tokens (default: the tenant's output budget)")
    ask.set_defaults(run=cmd_ask)

    tenants = sub.add_parser("tenants", help="tenant files").add_subparsers(dest="action", required=True)
    check = tenants.add_parser("check", help="validate a folder of tenant files; exit 2 if any is bad")
    check.add_argument("dir")
    check.set_defaults(run=cmd_tenants_check)

    models = sub.add_parser("models", help="model weights").add_subparsers(dest="action", required=True)
    fetch = models.add_parser("fetch", help="download, verify and convert the configured models")
    fetch.set_defaults(run=cmd_models_fetch)
