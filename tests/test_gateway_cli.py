"""The `sluice` command: tenants check, ingest, a local ask through the /v1/ask pipeline,
models fetch, serve (as a real process), and exit code 2 on bad arguments or files."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import cli
from gateway import commands
from gateway.usage.ledger import Ledger
from tests.test_gateway_support import KEYS, embedder, engine_config, tenant_toml  # noqa: F401


@pytest.fixture
def cli_env(tmp_path, tmp_path_factory, embedder, monkeypatch):
    """A server config naming the tiny models, a tenants folder, a data folder; the shared
    embedder stands in for a fresh one."""
    monkeypatch.setattr(commands, "_embedder", lambda: embedder)
    engine = engine_config(tmp_path_factory)
    config = tmp_path / "server.toml"
    config.write_text(f"""
max_inflight = 4
[engine]
block_size = 16
max_kv_blocks = 256
memory_budget_gb = 1.0
[engine.models.small]
source = "{engine.models['small'].source}"
[engine.models.large]
source = "{engine.models['large'].source}"
""")
    (tmp_path / "tenants").mkdir()
    (tmp_path / "tenants" / "alpha.toml").write_text(tenant_toml(KEYS["alpha"]))
    where = ["--tenants", str(tmp_path / "tenants"), "--data", str(tmp_path / "data")]
    return ["--config", str(config)], where


def test_tenants_check(tmp_path, capsys):
    assert cli.main(["tenants", "check", "examples/tenants"]) == 0
    assert capsys.readouterr().out.startswith("ok     demo: models small/large (default small)")
    (tmp_path / "good.toml").write_text(tenant_toml("sk-1"))
    (tmp_path / "bad.toml").write_text(tenant_toml("sk-2").replace("output_budget = 32", "output_budget = -5"))
    assert cli.main(["tenants", "check", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "ok     good" in out and f"{tmp_path / 'bad.toml'}: field 'output_budget': expected int >= 1" in err
    assert cli.main(["tenants", "check", str(tmp_path / "nowhere")]) == 2
    assert "tenants folder not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["tenants", "check", str(tmp_path / "empty")]) == 2
    assert "no tenant files" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["ask"], ["serve", "--port", "http"], ["ask", "q", "--mode", "huge"],
                                  ["ingest", "docs"], ["tenants"], ["eval"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and "sluice" in capsys.readouterr().err


def test_a_bad_server_config_exits_2_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "server.toml"
    bad.write_text("max_inflight = 0\n")
    assert cli.main(["--config", str(bad), "tenants", "check", "examples/tenants"]) == 2
    assert f"{bad}: field 'max_inflight': expected int >= 1" in capsys.readouterr().err
    bad.write_text('[prices.small]\ninput = 1.0\ncached_input = 1.0\noutput = 1.0\n'
                   '[engine.models.small]\nsource = "x"\n[engine.models.tiny]\nsource = "y"\n')
    assert cli.main(["--config", str(bad), "tenants", "check", "examples/tenants"]) == 2
    assert "field 'prices': no price for model(s) tiny" in capsys.readouterr().err
    assert cli.main(["--config", str(tmp_path / "none.toml"), "models", "fetch"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_ingest_then_ask_locally_through_the_ask_pipeline(tmp_path, cli_env, capsys):
    config, where = cli_env
    docs = tmp_path / "docs"
    (docs / "europe").mkdir(parents=True)
    (docs / "france.md").write_text("# France\n\nParis is the capital of France.")
    (docs / "europe" / "italy.txt").write_text("Rome is the capital of Italy.")
    (docs / "notes.bin").write_bytes(b"\x00")                       # not a document type: skipped
    assert cli.main([*config, "ingest", str(docs), "--collection", "kb", "--tenant", "alpha", *where]) == 0
    assert "alpha/kb: 2 documents (2 added, 0 replaced, 0 unchanged), 2 chunks (2 embedded anew)" in \
        capsys.readouterr().out

    argv = [*config, "ask", "What is the capital of France?", "--collection", "kb", "--tenant", "alpha",
            "--max-tokens", "5", *where]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 5                                      # the answer: five tiny-model words
    assert "[small: router not installed; tenant default; 2 passages]" in err
    assert "france.md France" in err and "europe/italy.txt" in err and "output tokens" in err
    [row] = Ledger(tmp_path / "data" / "ledger.sqlite").rows()
    assert (row.endpoint, row.tenant, row.collection, row.completion_tokens) == ("cli", "alpha", "kb", 5)

    assert cli.main([*config, "ask", "q", "--collection", "nope", "--tenant", "alpha", *where]) == 2
    assert "collection 'nope' not found" in capsys.readouterr().err
    assert cli.main([*config, "ask", "q", "--tenant", "zeta", *where]) == 2
    assert "no usable tenant 'zeta'" in capsys.readouterr().err
    assert cli.main([*config, "ingest", str(tmp_path / "missing"), "--collection", "kb", "--tenant", "alpha",
                     *where]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_models_fetch_resolves_the_configured_models(cli_env, capsys, tmp_path_factory):
    config, _ = cli_env
    assert cli.main([*config, "models", "fetch"]) == 0
    out = capsys.readouterr().out
    assert f"small: {engine_config(tmp_path_factory).models['small'].source}" in out


def test_the_demo_banner_is_a_ready_to_paste_curl():
    banner = commands.demo_banner("127.0.0.1", 8000)
    assert "curl -s http://127.0.0.1:8000/v1/ask -H 'Authorization: Bearer sk-sluice-demo'" in banner
    assert '"collection": "docs"' in banner
    assert commands.REPO / "README.md" in commands.demo_documents()


def test_serve_runs_a_server_until_interrupted(tmp_path, cli_env):
    config, where = cli_env
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cli", *config, "serve", "--port", str(port), *where],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240     # a loaded 2-core host took 92 s
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/ask", json={"question": "t1", "max_output_tokens": 3},
                       headers={"Authorization": f"Bearer {KEYS['alpha']}"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "ready: serving small, large" in out
