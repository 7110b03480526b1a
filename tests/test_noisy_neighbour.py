"""Through the public API: one tenant's hostile-but-valid sampling values, sent while other
tenants' requests decode in the same batches, fail no one, and change no one else's answer."""
from __future__ import annotations

import asyncio

import httpx

from tests.test_gateway_support import KEYS, Server, auth, embedder, llm, make_gateway  # noqa: F401

HOSTILE = [{"temperature": 0.7, "top_p": 1e-300}, {"temperature": 1e-138, "top_p": 0.9}, {"top_p": 5e-324}]


def test_hostile_sampling_values_fail_no_other_tenants_request(tmp_path, llm, embedder):
    gw = make_gateway(tmp_path, llm, embedder)
    ask = {"question": "t5 t6 t7", "max_output_tokens": 6}
    with Server(gw) as server:
        clean = httpx.post(f"{server.url}/v1/ask", json=ask, headers=auth("alpha"), timeout=60).json()["answer"]

        async def batch():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                steady = [client.post("/v1/ask", json=ask, headers=auth("alpha")) for _ in range(4)]
                hostile = [client.post("/v1/ask", json={**ask, **h}, headers=auth("beta")) for h in HOSTILE]
                return await asyncio.gather(*steady, *hostile)

        replies = asyncio.run(batch())
    assert [r.status_code for r in replies] == [200] * len(replies), [r.text for r in replies if r.status_code != 200]
    assert all(r.json()["answer"] == clean for r in replies[:4])       # greedy: the clean run's answer
    rows = gw.ledger.rows()
    assert len(rows) == 1 + len(replies) and {row.status for row in rows} == {"ok"}
