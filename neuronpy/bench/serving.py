"""Servers side by side, one at a time: each started by its own command, measured by the same
closed-loop client, stopped before the next one starts (a CPU benchmark counts only on a quiet
machine: two servers at once slow each other, llama.cpp's most of all).

    python -m neuronpy.bench.random_model llama3.2-1b /tmp/llama1b --gguf Q4_K_M
    F=/tmp/llama1b-Q4_K_M.gguf
    python -m neuronpy.bench.serving --k 1,8,16 --rounds 2 \\
      --server "neuronpy=8000=neuronpy serve --model $F --port 8000 --max-in-flight 16" \\
      --server "llama-server=8200=GGUF=$F ../shared/peers/llama-server.sh serve 8200 16"

Each `--server NAME=PORT=COMMAND` is a shell command that serves an OpenAI-compatible API on
127.0.0.1:PORT; it runs in a process group of its own, which is ended (SIGTERM, then SIGKILL)
after its points. At each K: one untimed request, then K concurrent streams, each
`--per-stream` requests in turn (closed loop, as `vllm bench serve --max-concurrency K
--num-prompts per_stream*K`), every request `--prompt-len` random token ids in and
`--output-len` tokens out, greedy, EOS ignored. Every server gets the same prompts. Rounds
repeat the whole line-up (server after server), so that the machine's drift shows as the
difference between rounds rather than as a gap between two servers. The table gives output
tokens/s and TPOT p50 per server and round, and every server's tokens/s over the first's;
`--out` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from neuronpy.bench.driver import drive
from neuronpy.bench.http_client import completions_send, make_client, served_models
from neuronpy.bench.metrics import summarize
from neuronpy.bench.records import RequestRecord, RunSummary, span
from neuronpy.bench.workloads import BenchRequest, PromptSource


@dataclass(frozen=True)
class Server:
    """A server to measure: its name, the loopback port it serves and the command that starts
    it."""

    name: str
    port: int
    command: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Server:
        """`NAME=PORT=COMMAND`."""
        name, sep, rest = text.partition("=")
        port, sep2, command = rest.partition("=")
        if not (sep and sep2 and name and command.strip() and port.isdigit()):
            raise ValueError(f"--server takes NAME=PORT=COMMAND, got {text!r}")
        return cls(name, int(port), command.strip())


@dataclass
class Point:
    """One server at one K in one round."""

    server: str
    round: int
    k: int
    summary: RunSummary
    started_s: float  # when the server was started, seconds since the run began
    stopped_s: float  # when it had ended


@dataclass
class Lineup:
    """Every point of a run, and what was asked."""

    params: dict[str, Any]
    points: list[Point] = field(default_factory=list)

    def tok_s(self, server: str, k: int) -> list[float]:
        """`server`'s output tokens/s at `k`, one per round that measured it."""
        return [
            p.summary.output_tok_s or 0.0 for p in self.points if p.server == server and p.k == k
        ]


def closed_loop(
    source: PromptSource, k: int, per_stream: int, prompt_len: int, output_len: int
) -> list[list[BenchRequest]]:
    """K streams of `per_stream` requests each, the same for every server."""
    return [
        [
            BenchRequest(source.prompt(f"serving:{k}:{s}:{j}", prompt_len), output_len)
            for j in range(per_stream)
        ]
        for s in range(k)
    ]


async def _measure(url: str, model: str, streams: list[list[BenchRequest]]) -> RunSummary:
    """Each stream sends its requests one after the other; the streams run at once."""
    client = await make_client(max_connections=len(streams) + 1)
    async with client:
        send = completions_send(client, url, model)
        await drive([streams[0][0]], send)  # untimed: the first request pays the warm-up
        records: list[RequestRecord] = []
        t0 = time.perf_counter()

        async def stream(requests: list[BenchRequest]) -> None:
            for request in requests:
                begun = time.perf_counter() - t0
                done, _ = await drive([request], send)
                records.extend(_shifted(r, begun) for r in done)

        async with anyio.create_task_group() as tg:
            for requests in streams:
                tg.start_soon(stream, requests)
    return summarize(records, span(tuple(records)))


def _shifted(record: RequestRecord, by: float) -> RequestRecord:
    """A record timed from its own send, moved onto the run's clock."""
    times = tuple(t + by for t in record.chunk_times)
    return dataclasses.replace(record, sent=record.sent + by, chunk_times=times)


def start(server: Server, log: Path, timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    """Starts `server`'s command in a process group of its own and waits until it lists a
    model; returns the process and the model's id."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            ["bash", "-c", server.command],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{server.name} exited ({process.returncode}); see {log}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            models = served_models(server.url)
            if models and models[0]:
                return process, str(models[0])
        if time.monotonic() > deadline:
            stop(process)
            raise RuntimeError(f"{server.name} did not serve within {timeout:.0f} s; see {log}")
        time.sleep(0.5)


def stop(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """Ends the server's whole process group: SIGTERM, then SIGKILL after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    # the group's other members (a server's engine process) end with it
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def run(
    servers: Sequence[Server],
    ks: Sequence[int],
    *,
    rounds: int = 1,
    per_stream: int = 2,
    prompt_len: int = 128,
    output_len: int = 128,
    vocab: int = 32000,
    log_dir: Path = Path("bench-results"),
    start_timeout: float = 900.0,
    echo: Any = print,
) -> Lineup:
    """Every server at every K, one server at a time, `rounds` times over."""
    names = [s.name for s in servers]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must differ: {names}")
    source = PromptSource(vocab, seed=0)
    lineup = Lineup(
        params={
            "servers": [asdict(s) for s in servers],
            "k": list(ks),
            "rounds": rounds,
            "per_stream": per_stream,
            "prompt_len": prompt_len,
            "output_len": output_len,
        }
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for round_ in range(1, rounds + 1):
        for server in servers:
            began = time.monotonic() - t0
            process, model = start(server, log_dir / f"{server.name}.log", start_timeout)
            summaries: list[tuple[int, RunSummary]] = []
            try:
                for k in ks:
                    streams = closed_loop(source, k, per_stream, prompt_len, output_len)
                    summary = anyio.run(_measure, server.url, model, streams)
                    summaries.append((k, summary))
                    echo(f"round {round_} {server.name} K={k}: {_cell(summary)}")
            finally:
                stop(process)
            ended = time.monotonic() - t0
            for k, summary in summaries:
                lineup.points.append(Point(server.name, round_, k, summary, began, ended))
    return lineup


def _cell(summary: RunSummary) -> str:
    tok_s = summary.output_tok_s or 0.0
    tpot = summary.tpot_ms.p50
    failed = f", {summary.failed} of {summary.requests} failed" if summary.failed else ""
    return f"{tok_s:.1f} tok/s (TPOT p50 {tpot:.0f} ms{failed})" if tpot else f"{tok_s:.1f}"


def table(lineup: Lineup) -> str:
    """Markdown: a row per K and round, a column per server, then each server over the first."""
    servers = [s["name"] for s in lineup.params["servers"]]
    header = ["K", "round", *servers, *(f"{s} / {servers[0]}" for s in servers[1:])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for k in lineup.params["k"]:
        for round_ in range(1, lineup.params["rounds"] + 1):
            cells: dict[str, RunSummary] = {
                p.server: p.summary for p in lineup.points if p.k == k and p.round == round_
            }
            row = [str(k), str(round_)]
            row += [_cell(cells[s]) if s in cells else "-" for s in servers]
            first = cells.get(servers[0])
            for s in servers[1:]:
                a = first.output_tok_s if first else None
                b = cells[s].output_tok_s if s in cells else None
                row.append(f"{b / a:.2f}x" if a and b else "-")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def to_json(lineup: Lineup) -> dict[str, Any]:
    return {"params": lineup.params, "points": [asdict(p) for p in lineup.points]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neuronpy.bench.serving", description=__doc__)
    parser.add_argument("--server", action="append", required=True, metavar="NAME=PORT=COMMAND")
    parser.add_argument("--k", default="1,8,16", help="concurrent streams, comma-separated")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--per-stream", type=int, default=2, help="requests each stream sends")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn below it")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--logs", type=Path, default=Path("bench-results"))
    parser.add_argument("--out", type=Path, help="write every figure here as JSON")
    args = parser.parse_args(argv)
    try:
        servers = [Server.parse(s) for s in args.server]
        ks = [int(k) for k in args.k.split(",") if k.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if not ks or min(ks) < 1 or args.rounds < 1 or args.per_stream < 1:
        parser.error("--k, --rounds and --per-stream must be positive")
    lineup = run(
        servers,
        ks,
        rounds=args.rounds,
        per_stream=args.per_stream,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        vocab=args.vocab,
        log_dir=args.logs,
        start_timeout=args.start_timeout,
    )
    print(table(lineup))
    if args.out:
        args.out.write_text(json.dumps(to_json(lineup), indent=1, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] if len(sys.argv) > 1 else None))
