"""The benchmark's HTTP client of an OpenAI-compatible server: a request streamed from
/v1/completions (server-sent events) as the load driver's `Send`, the served models, and the
engine's counters from GET /stats."""

from __future__ import annotations

import json
from typing import Any

import httpx

from neuronpy.bench.driver import OnChunk, Reply, Send
from neuronpy.bench.workloads import BenchRequest


async def make_client(max_connections: int) -> httpx.AsyncClient:
    """A client for one run (made in, and used from, the event loop that awaits this)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits)


def completions_send(client: httpx.AsyncClient, url: str, model: str) -> Send:
    """Each request as a streamed completion of its prompt's token ids, greedy, EOS ignored
    (a W5 request under its JSON schema); its text is kept for parity."""

    async def send(req: BenchRequest, on_chunk: OnChunk) -> Reply:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(req.prompt_ids),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.schema is not None:
            schema = {"name": "w5", "schema": json.loads(req.schema)}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        text: list[str] = []
        tokens = 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                raise RuntimeError(f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"].get("message", chunk["error"])))
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    on_chunk(0)  # the SSE chunk does not say how many tokens it carries
                    text.append(choices[0]["text"])
                usage = chunk.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens", 0))
        # a server without usage: one token per chunk
        return Reply(output_tokens=tokens or None, text="".join(text))

    return send


def served_models(url: str) -> list[str]:
    """The model ids GET /v1/models lists."""
    models = httpx.get(f"{url}/v1/models", timeout=30).json().get("data") or []
    return [m.get("id") for m in models]


def fetch_stats(url: str, model: str) -> dict[str, Any] | None:
    """`model`'s engine counters from GET /stats; None where the server has none to give."""
    try:
        body = httpx.get(f"{url}/stats", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    return stats_from_json(body, model)


def stats_from_json(body: Any, model: str) -> dict[str, Any] | None:
    """An engine's counters out of GET /stats (one model at the top, or a list / map of them)."""
    if not isinstance(body, dict):
        return None
    if "decode_steps" in body:
        return body
    models = body.get("models")
    if isinstance(models, dict):
        entry = models.get(model) or next(iter(models.values()), None)
        return entry if isinstance(entry, dict) else None
    if isinstance(models, list):
        for entry in models:
            if isinstance(entry, dict) and entry.get("model") in (model, None):
                return entry
    return None
