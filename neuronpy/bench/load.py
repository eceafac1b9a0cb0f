"""`python -m neuronpy.bench.load`: a bounded load run against a running server.

Sends a fixed number of short requests (streamed or not, chat or completions) from a fixed
number of concurrent clients, cancels a share of the streamed ones mid-stream by closing the
connection, and counts what came back: served (200 and the full length), rejected (503 or 429
with Retry-After), cancelled (by the client, on purpose) and failed (anything else: another
status, a broken stream, a short answer, a transport error). Exits 1 if any request failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

PROMPTS = (
    "Once upon a time",
    "The quick brown fox",
    "Servers that handle many requests",
    "She ordered a café au lait",
    "In 1984 the station recorded",
    "What changed? Mostly the roads",
)


@dataclass(frozen=True)
class LoadRequest:
    """One request of the run: what to send, and whether to hang up after its first chunk."""

    chat: bool
    stream: bool
    cancel: bool
    max_tokens: int
    prompt: str


@dataclass
class LoadReport:
    """What a load run saw. `failed` counts every outcome that was neither served, rejected
    with a Retry-After, nor cancelled on purpose; `errors` holds the first few, described."""

    requests: int = 0
    served: int = 0
    rejected: int = 0
    cancelled: int = 0
    failed: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # of served requests, seconds

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.errors) < 10:
            self.errors.append(why)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 4) if lat else None

        return {
            "requests": self.requests,
            "served": self.served,
            "rejected": self.rejected,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "seconds": round(self.seconds, 3),
            "requests_per_s": round(self.requests / self.seconds, 2) if self.seconds else None,
            "latency_p50_s": pct(0.5),
            "latency_p99_s": pct(0.99),
            "errors": self.errors,
        }


def plan(
    requests: int,
    *,
    min_tokens: int = 4,
    max_tokens: int = 16,
    stream_share: float = 0.5,
    cancel_share: float = 0.2,
    seed: int = 0,
) -> list[LoadRequest]:
    """The run's requests, the same for the same arguments. Only streamed requests are
    cancelled: `cancel_share` of all requests (at most every streamed one)."""
    rng = random.Random(seed)
    streamed = round(requests * stream_share)
    cancelled = min(streamed, round(requests * cancel_share))
    kinds = [(True, True)] * cancelled + [(True, False)] * (streamed - cancelled)
    kinds += [(False, False)] * (requests - streamed)
    rng.shuffle(kinds)
    return [
        LoadRequest(
            chat=rng.random() < 0.5,
            stream=stream,
            cancel=cancel,
            max_tokens=rng.randint(min_tokens, max_tokens),
            prompt=rng.choice(PROMPTS),
        )
        for stream, cancel in kinds
    ]


async def run_load(
    url: str,
    requests: Sequence[LoadRequest],
    *,
    concurrency: int = 32,
    model: str | None = None,
    timeout: float = 120.0,
) -> LoadReport:
    """Send `requests` to the server at `url` from `concurrency` clients at once."""
    report = LoadReport(requests=len(requests))
    pending = iter(requests)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    started = time.perf_counter()
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), timeout=timeout, limits=limits
    ) as client:

        async def worker() -> None:
            for req in pending:
                began = time.perf_counter()
                try:
                    served = await _one(client, req, model, report)
                except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
                    report.fail(f"{type(exc).__name__}: {exc}")
                    continue
                if served:
                    report.served += 1
                    report.latencies.append(time.perf_counter() - began)

        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker)
    report.seconds = time.perf_counter() - started
    return report


async def _one(
    client: httpx.AsyncClient, req: LoadRequest, model: str | None, report: LoadReport
) -> bool:
    """Send one request; True if it was served whole. Other outcomes are counted here."""
    body: dict[str, Any] = {
        "max_tokens": req.max_tokens,
        "ignore_eos": True,  # every served request has exactly max_tokens tokens
        "temperature": 0.0,
    }
    if model is not None:
        body["model"] = model
    if req.chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = req.prompt
    if req.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return _refused(response, report)
        if not req.stream:
            await response.aread()
            out = response.json()
            finish = out["choices"][0]["finish_reason"]
            tokens = out["usage"]["completion_tokens"]
            if finish != "length" or tokens != req.max_tokens:
                report.fail(f"finish_reason {finish}, {tokens}/{req.max_tokens} tokens")
                return False
            return True
        finish, tokens, done = None, None, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                report.fail(f"error event: {chunk['error'].get('message')}")
                return False
            if req.cancel and chunk.get("choices"):
                report.cancelled += 1  # hang up mid-stream: leaving the block closes it
                return False
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                finish = choice.get("finish_reason") or finish
        if not done or finish != "length" or tokens != req.max_tokens:
            report.fail(f"stream ended: done={done}, finish {finish}, {tokens} tokens")
            return False
        return True


def _refused(response: httpx.Response, report: LoadReport) -> bool:
    """A 503/429 with an integer Retry-After and an error body is a clean rejection."""
    retry = response.headers.get("retry-after", "")
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = None
    if response.status_code in (429, 503) and retry.isdigit() and isinstance(error, dict):
        report.rejected += 1
    else:
        report.fail(f"HTTP {response.status_code}: {response.text[:200]}")
    return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m neuronpy.bench.load",
        description="A bounded load run against a running neuronpy server: served, rejected, "
        "cancelled and failed counts (exit 1 if any failed).",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", help="the model to ask for (default: the server's first)")
    parser.add_argument("--requests", type=int, default=300, help="requests in all (300)")
    parser.add_argument("--concurrency", type=int, default=32, help="clients at once (32)")
    parser.add_argument("--min-tokens", type=int, default=4, help="shortest max_tokens (4)")
    parser.add_argument("--max-tokens", type=int, default=16, help="longest max_tokens (16)")
    parser.add_argument(
        "--stream-share", type=float, default=0.5, help="share of streamed requests (0.5)"
    )
    parser.add_argument(
        "--cancel-share",
        type=float,
        default=0.2,
        help="share of requests cancelled mid-stream by closing the connection (0.2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the run's random seed (0)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or not 1 <= args.min_tokens <= args.max_tokens:
        parser.error("--requests and --concurrency must be >= 1, and min <= max tokens")
    if not 0 <= args.cancel_share <= args.stream_share <= 1:
        parser.error("need 0 <= --cancel-share <= --stream-share <= 1")
    requests = plan(
        args.requests,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        stream_share=args.stream_share,
        cancel_share=args.cancel_share,
        seed=args.seed,
    )
    report = anyio.run(
        lambda: run_load(
            args.url, requests, concurrency=args.concurrency, model=args.model, timeout=args.timeout
        )
    )
    print(json.dumps(report.summary(), indent=2))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
