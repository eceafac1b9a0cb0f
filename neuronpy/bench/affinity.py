"""What session affinity buys behind a router: the second turn's time to first token.

`python -m neuronpy.bench.affinity --url ROUTER` holds N two-turn conversations, one after
another, each opening with a long system prompt of its own; the first turn is asked whole, the
second (the history plus a question) streamed, timing its first token and reading its
`cached_tokens`. `--session header` sends `X-Session-ID` with both turns (vllm-router's
consistent_hash keeps them on one replica, whose prefix cache holds the first); `--session
body` names a session in the body (with a shared --sessions-dir any replica restores it);
`none` sends neither (round_robin then puts the second turn on the other replica, which
prefills it all). Run the router with the policy each case needs (docs/replicas.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

SESSIONS = ("header", "body", "none")
LANDSCAPE = (
    "river mountain valley forest meadow harbor island desert canyon glacier lagoon prairie "
    "delta plateau marsh tundra savanna reef fjord estuary volcano steppe dune cliff"
)
WORDS = LANDSCAPE.split()


def system_prompt(index: int, words: int) -> str:
    """A long system prompt of its own per conversation (nothing shared between them)."""
    body = " ".join(WORDS[(index * 7 + i * 3) % len(WORDS)] for i in range(words))
    return f"Conversation {index} ({uuid.uuid4().hex}). Keep these notes in mind: {body}."


def second_turn_ttft(
    client: httpx.Client,
    url: str,
    model: str | None,
    index: int,
    words: int,
    session: str,
) -> tuple[float, int, int]:
    """One conversation: (the second turn's TTFT in seconds, its cached tokens, its prompt)."""
    name = f"affinity-{index}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Session-ID": name} if session == "header" else {}
    extra: dict[str, Any] = {"session": name} if session == "body" else {}
    base: dict[str, Any] = {"max_tokens": 16, "temperature": 0, **extra}
    if model is not None:
        base["model"] = model
    messages = [
        {"role": "system", "content": system_prompt(index, words)},
        {"role": "user", "content": "Name three rivers of Europe."},
    ]
    first = client.post(
        f"{url}/v1/chat/completions", json={**base, "messages": messages}, headers=headers
    )
    first.raise_for_status()
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Which of them is the longest?"},
    ]
    body = {
        **base,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft if ttft is not None else float("nan"), cached, usage.get("prompt_tokens", 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m neuronpy.bench.affinity",
        description="The second turn's time to first token behind a router, with session "
        "affinity or without.",
    )
    parser.add_argument("--url", required=True, help="the router (or a server)")
    parser.add_argument("--model", help="the model to ask (default: the server's only one)")
    parser.add_argument("--session", choices=SESSIONS, default="header")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--words", type=int, default=600, help="system prompt words (600)")
    args = parser.parse_args(argv)
    rows = []
    with httpx.Client(timeout=600) as client:
        for i in range(args.conversations):
            rows.append(second_turn_ttft(client, args.url, args.model, i, args.words, args.session))
    ttfts = [r[0] for r in rows]
    result = {
        "session": args.session,
        "conversations": len(rows),
        "second_turn_prompt_tokens": statistics.mean(r[2] for r in rows),
        "second_turn_cached_tokens": statistics.mean(r[1] for r in rows),
        "second_turn_ttft_ms_median": round(statistics.median(ttfts) * 1000, 1),
        "second_turn_ttft_ms_mean": round(statistics.mean(ttfts) * 1000, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
