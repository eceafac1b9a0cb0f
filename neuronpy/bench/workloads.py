"""The benchmark workloads of bench.md (W1-W4, and W5-W6 of our own) as plain lists of requests.

Prompts are synthetic token ids drawn from a seeded generator (special tokens left out), so
every system sees exactly the same prompts, and prompt i of a workload is the same at every K;
W6's are chat prompts of generated texts (bench/grounded.py), rendered once as token ids.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6")
# the workloads a system without constrained decoding runs (W5 needs it)
UNCONSTRAINED = frozenset({"W1", "W2", "W3", "W4", "W6"})

DESCRIPTIONS = {
    "W1": "closed loop: K concurrent streams",
    "W2": "staggered: Poisson arrivals at a share of W1's peak, mixed lengths",
    "W3": "burst: every request at t=0, mixed lengths",
    "W4": "long prefill: one long prompt joins while 7 streams decode",
    "W5": "structured: W1's K streams, each held to a JSON schema of its own",
    "W6": "input-grounded: K streams whose replies copy spans of their prompts (code edits, "
    "quotes, lists: what prompt lookup drafts)",
}


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    `arrival` is when it is sent, in seconds after the workload starts. A request with
    `after_tokens` set is sent instead as soon as every earlier request has received at least
    that many tokens (W4's join); its `arrival` is then ignored.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival: float = 0.0
    after_tokens: int | None = None
    tag: str = ""  # W4: "decode" or "join"
    schema: str | None = None  # W5: the JSON Schema (its text) the output must match


@dataclass(frozen=True)
class Workload:
    """One measured point: a workload at one setting (W1 at one K, W2 at one load, ...)."""

    name: str  # W1 .. W4
    point: str  # "K=8", "load=0.75", "burst", "join"
    requests: tuple[BenchRequest, ...]
    concurrency: int | None = None  # W1: K (static batches are K wide)
    params: dict[str, object] = field(default_factory=dict)

    @property
    def triggered(self) -> bool:
        return any(r.after_tokens is not None for r in self.requests)

    @property
    def max_prompt_len(self) -> int:
        return max(len(r.prompt_ids) for r in self.requests)

    @property
    def max_output_len(self) -> int:
        return max(r.max_tokens for r in self.requests)


class PromptSource:
    """Deterministic synthetic prompts: token ids drawn uniformly from the ordinary vocabulary."""

    def __init__(self, vocab_size: int, special_ids: Collection[int] = (), seed: int = 0):
        self.seed = seed
        special = set(special_ids)
        self._ids = [i for i in range(vocab_size) if i not in special]
        if not self._ids:
            raise ValueError("the vocabulary has no ordinary tokens to build prompts from")

    def prompt(self, key: str, length: int) -> tuple[int, ...]:
        """The prompt named `key` (the same key always gives the same ids)."""
        rng = random.Random(f"{self.seed}:{key}")
        return tuple(rng.choice(self._ids) for _ in range(length))


def w1(source: PromptSource, k: int, prompt_len: int, output_len: int) -> Workload:
    """K concurrent streams, each one request of `prompt_len` tokens and `output_len` tokens."""
    requests = tuple(
        BenchRequest(source.prompt(f"W1:{i}", prompt_len), output_len) for i in range(k)
    )
    return Workload(
        "W1",
        f"K={k}",
        requests,
        concurrency=k,
        params={"k": k, "prompt_len": prompt_len, "output_len": output_len},
    )


def w5_schema(i: int) -> str:
    """Request i's schema: an object holding an array of strings under a key of its own,
    with more items than any output can hold, so that every request writes all its tokens
    (as W1's, EOS ignored) and W5 compares with W1 token for token."""
    schema = {
        "type": "object",
        "properties": {
            f"items_{i}": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8 + i % 24},
                "minItems": 100_000,
            }
        },
        "required": [f"items_{i}"],
    }
    return json.dumps(schema)


def w5(source: PromptSource, k: int, prompt_len: int, output_len: int) -> Workload:
    """W1 at K (the same prompts), each request constrained by a schema of its own."""
    plain = w1(source, k, prompt_len, output_len)
    requests = tuple(
        BenchRequest(r.prompt_ids, r.max_tokens, schema=w5_schema(i))
        for i, r in enumerate(plain.requests)
    )
    return Workload("W5", plain.point, requests, concurrency=k, params=plain.params)


def w6(prompts: Sequence[tuple[int, ...]], k: int, output_len: int) -> Workload:
    """K concurrent streams of the first K input-grounded prompts (their replies copy spans of
    the prompt), `output_len` tokens each (EOS ignored, as W1's)."""
    if len(prompts) < k:
        raise ValueError(f"W6 at K={k} needs {k} prompts, got {len(prompts)}")
    requests = tuple(BenchRequest(tuple(p), output_len) for p in prompts[:k])
    return Workload(
        "W6",
        f"K={k}",
        requests,
        concurrency=k,
        params={"k": k, "output_len": output_len, "prompt_len": max(len(p) for p in prompts[:k])},
    )


def mixed_lengths(
    source: PromptSource,
    name: str,
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
) -> list[tuple[tuple[int, ...], int]]:
    """n (prompt, max_tokens) pairs, lengths uniform in the (inclusive) ranges, seeded."""
    rng = random.Random(f"{source.seed}:{name}:lengths")
    pairs = []
    for i in range(n):
        p = rng.randint(*prompt_range)
        o = rng.randint(*output_range)
        pairs.append((source.prompt(f"{name}:{i}", p), o))
    return pairs


def w2(
    source: PromptSource,
    n: int,
    rate: float,
    load: float,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
) -> Workload:
    """n requests with Poisson arrivals at `rate` requests/s (exponential gaps, seeded)."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"W2 needs a positive arrival rate, got {rate!r}")
    rng = random.Random(f"{source.seed}:W2:arrivals")
    t = 0.0
    requests = []
    for i, (prompt, out) in enumerate(mixed_lengths(source, "W2", n, prompt_range, output_range)):
        if i:
            t += rng.expovariate(rate)
        requests.append(BenchRequest(prompt, out, arrival=t))
    return Workload(
        "W2",
        f"load={load:g}",
        tuple(requests),
        params={
            "requests": n,
            "load": load,
            "rate_rps": rate,
            "prompt_range": list(prompt_range),
            "output_range": list(output_range),
        },
    )


def w3(
    source: PromptSource,
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
) -> Workload:
    """n requests of mixed lengths, all sent at t=0."""
    pairs = mixed_lengths(source, "W3", n, prompt_range, output_range)
    return Workload(
        "W3",
        f"burst={n}",
        tuple(BenchRequest(p, o) for p, o in pairs),
        params={
            "requests": n,
            "prompt_range": list(prompt_range),
            "output_range": list(output_range),
        },
    )


def w4(
    source: PromptSource,
    decoders: int,
    prompt_len: int,
    decode_len: int,
    long_prompt_len: int,
    join_output: int = 16,
    join_after: int = 8,
) -> Workload:
    """`decoders` streams start together; once each has `join_after` tokens, one request with a
    `long_prompt_len`-token prompt joins. The decoders are given enough tokens to outlast it."""
    requests = [
        BenchRequest(source.prompt(f"W4:{i}", prompt_len), decode_len, tag="decode")
        for i in range(decoders)
    ]
    requests.append(
        BenchRequest(
            source.prompt("W4:long", long_prompt_len),
            join_output,
            after_tokens=join_after,
            tag="join",
        )
    )
    return Workload(
        "W4",
        f"join={long_prompt_len}",
        tuple(requests),
        params={
            "decoders": decoders,
            "prompt_len": prompt_len,
            "decode_len": decode_len,
            "long_prompt_len": long_prompt_len,
            "join_output": join_output,
            "join_after_tokens": join_after,
        },
    )


def poisson_rate(peak_tok_s: float, load: float, output_range: Sequence[int]) -> float:
    """Requests/s that ask for `load` of a peak output tokens/s, at the mean output length."""
    mean_out = (output_range[0] + output_range[1]) / 2
    return load * peak_tok_s / mean_out
