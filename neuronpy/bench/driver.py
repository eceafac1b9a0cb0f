"""The load driver for the systems streamed through async code (neuronpy in-process and over
HTTP): every request of a workload sent at its arrival time or when its join condition holds,
each reply's chunks timestamped as they arrive, one `RequestRecord` per request.

A system plugs in a `Send`: it sends one request, calls `on_chunk(tokens)` for each chunk of
the reply that carries tokens (0: the chunk does not say how many), and returns what else it
read as a `Reply`. Concurrency is the workload's: W1's K requests all arrive at 0.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio

from neuronpy.bench.records import RequestRecord, Trace, span
from neuronpy.bench.workloads import BenchRequest

OnChunk = Callable[[int], None]


@dataclass(frozen=True)
class Reply:
    """What a client read of one reply, beside its chunks' times."""

    output_tokens: int | None = None  # None: not reported, one token per chunk is counted
    token_ids: tuple[int, ...] | None = None  # where the system reports them (parity)
    text: str | None = None
    error: str | None = None  # a reply that ended badly without raising


Send = Callable[[BenchRequest, OnChunk], Awaitable[Reply]]


async def drive(
    requests: Sequence[BenchRequest], send: Send
) -> tuple[tuple[RequestRecord, ...], float]:
    """Sends every request through `send` at its arrival time, or once every earlier
    ungated request has received `after_tokens` tokens (W4's join). Returns the records and
    the run's duration (first send to last chunk). A request whose send raises is recorded
    with the error; the others go on."""
    n = len(requests)
    traces = [Trace(prompt_tokens=len(r.prompt_ids), tag=r.tag) for r in requests]
    progress = [0] * n
    finished = [False] * n
    gates = {i: anyio.Event() for i, r in enumerate(requests) if r.after_tokens is not None}
    t0 = time.perf_counter()

    def check_gates() -> None:
        for j, gate in gates.items():
            need = requests[j].after_tokens or 0
            earlier = [i for i in range(j) if i not in gates]
            if not gate.is_set() and all(finished[i] or progress[i] >= need for i in earlier):
                gate.set()

    def chunk(i: int, tokens: int) -> None:
        traces[i].chunk_times.append(time.perf_counter() - t0)
        progress[i] += max(tokens, 1)
        if gates:
            check_gates()

    async def one(i: int) -> None:
        req = requests[i]
        if i in gates:
            await gates[i].wait()
        else:
            delay = t0 + req.arrival - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
        trace = traces[i]
        trace.sent = time.perf_counter() - t0
        try:
            reply = await send(req, lambda tokens: chunk(i, tokens))
        except Exception as exc:
            trace.error = f"{type(exc).__name__}: {exc}"[:300]
        else:
            count = reply.output_tokens
            trace.output_tokens = len(trace.chunk_times) if count is None else count
            trace.token_ids = None if reply.token_ids is None else list(reply.token_ids)
            trace.text, trace.error = reply.text, reply.error
        finally:
            finished[i] = True
            if gates:
                check_gates()

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    records = tuple(t.record() for t in traces)
    return records, span(records)


async def precompile(requests: Sequence[BenchRequest], send: Send) -> None:
    """W5's schemas compiled before its measured run: each request once with one output token
    (untimed). W5 then measures what constrained decoding costs per step; compiling is a cost
    per distinct schema, counted by /metrics (neuronpy_grammar_compile_seconds)."""
    first = [dataclasses.replace(r, max_tokens=1, arrival=0.0) for r in requests if r.schema]
    if first:
        await drive(first, send)
