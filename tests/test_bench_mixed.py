"""bench/mixed.py's clients send what they are counted as."""

from __future__ import annotations

import asyncio
import json

import httpx

from cdlm_serve.bench import mixed


def test_each_kind_of_client_sends_its_own_model(monkeypatch):
    """Every kind's requests go to its model (a closure over a reassigned body once sent DLM
    requests from the AR clients, tallied as AR)."""
    seen: list[dict] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.001)  # a server takes a while: the other clients get their turn
        body = json.loads(await request.aread())
        seen.append(body)
        tokens = 1 if body["model"] == "ar-model" else 1000
        if body.get("stream"):
            chunk = {"choices": [{"text": "x"}], "usage": {"completion_tokens": tokens}}
            text = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
            return httpx.Response(200, text=text)
        return httpx.Response(200, json={"usage": {"completion_tokens": tokens}})

    real = httpx.AsyncClient
    monkeypatch.setattr(
        mixed.httpx,
        "AsyncClient",
        lambda **kw: real(transport=httpx.MockTransport(answer), **kw),
    )
    soak = mixed.Soak("http://test", "ar-model", "dlm-model", session_ids=[1, 2, 3])
    result = asyncio.run(soak.phase(("ar", "ar-stream", "dlm"), 0.3))
    assert result["ar"]["requests"] > 0 and result["dlm"]["requests"] > 0
    # AR answers count 1 token, DLM answers 1,000: each tally holds only its own model's.
    assert result["ar"]["tokens"] == result["ar"]["requests"]
    assert result["ar-stream"]["tokens"] == result["ar-stream"]["requests"]
    assert result["dlm"]["tokens"] == 1000 * result["dlm"]["requests"]
    assert all(("decoding" in b) == (b["model"] == "dlm-model") for b in seen)
