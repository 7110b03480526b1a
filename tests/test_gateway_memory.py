"""The memory budget: by default a share of the memory available at start-up, whether the
server has a config file or not; an explicit budget stands; the start-up statement of what it
holds."""
from __future__ import annotations

import pytest

from gateway import config
from gateway.config import MEMORY_SHARE, ServerConfig, available_memory_gb, load_server_config
from tests.test_gateway_support import llm  # noqa: F401

MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:   16777216 kB
Buffers:          100000 kB
"""


def test_available_memory_is_memavailable(tmp_path):
    (tmp_path / "meminfo").write_text(MEMINFO)
    assert available_memory_gb(tmp_path / "meminfo") == 16.0
    assert available_memory_gb(tmp_path / "absent") > 0.1        # no /proc: the physical memory


@pytest.fixture
def sixteen_gb(monkeypatch):
    monkeypatch.setattr(config, "available_memory_gb", lambda: 16.0)


def test_the_default_budget_is_a_share_of_what_is_available_with_or_without_a_config_file(tmp_path, sixteen_gb):
    assert ServerConfig().engine.memory_budget_gb == round(MEMORY_SHARE * 16.0, 1) == 6.4
    path = tmp_path / "server.toml"
    path.write_text('[engine]\nblock_size = 32\n[engine.models.small]\nsource = "x"\n'
                    '[prices.small]\ninput = 1.0\ncached_input = 1.0\noutput = 1.0\n')
    engine = load_server_config(path).engine
    assert (engine.memory_budget_gb, engine.block_size) == (6.4, 32)
    path.write_text(path.read_text().replace("block_size = 32", "memory_budget_gb = 3.0"))
    assert load_server_config(path).engine.memory_budget_gb == 3.0


def test_the_memory_plan_states_each_models_weights_and_kv_blocks(llm):
    plan = llm.memory_plan()
    blocks = {name: s["kv_blocks_total"] for name, s in llm.stats().items()}
    assert plan.startswith("memory budget 1 GiB: small: weights 0.00 GiB (none), ")
    for name in ("small", "large"):                 # tiny models: 2 layers, 2 KV heads of 16, float32
        kv = blocks[name] * 2 * 2 * 16 * 2 * 16 * 4
        assert f"{name}: " in plan and f"{blocks[name]} KV blocks of 16 tokens = {kv / 2**30:.2f} GiB (float32)" in plan
