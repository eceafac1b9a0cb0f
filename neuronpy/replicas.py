"""`neuronpy replicas`: N `neuronpy serve` processes on one machine, each pinned to its own
cores, behind vllm-router (a router built for LLM serving: health checks, retries, circuit
breakers, session affinity), supervised: a replica that exits (drained, or crashed) is started
again, SIGHUP drains and restarts them one at a time, SIGTERM or Ctrl-C drains them all.

What it prints: a line per replica started, one when it is ready, one when the router serves
them all; the router's own log at warning (`--router-log-level` for more), without the lines
it prints at start-up whatever its level, and without colour codes unless written to a terminal.

The router is vllm-router from PyPI (`pip install vllm-router`); nothing here routes requests.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TextIO

from neuronpy.envflags import colour

log = logging.getLogger("neuronpy.replicas")

# vllm-router's policies (`--policy`): cache_aware keeps a conversation where its prefix is
# and balances the rest; consistent_hash keeps a session (X-Session-ID) on one replica
POLICIES = (
    "cache_aware",
    "consistent_hash",
    "power_of_two",
    "round_robin",
    "random",
    "sticky_least_loaded",
)
ROUTER_MISSING = (
    "vllm-router is not installed: `pip install vllm-router` (a Rust router on PyPI), or pass "
    "--router PATH"
)
# flags `neuronpy replicas` sets on each replica itself
OWN_SERVE_FLAGS = ("--host", "--port")
HEALTH_INTERVAL = 2  # seconds between the router's health checks of each replica
# seconds a draining replica still admits while /health says 503: past the router's next
# health checks (HEALTH_FAILURES of them, HEALTH_INTERVAL apart), so it sends nothing more
HEALTH_FAILURES = 2
DRAIN_GRACE = HEALTH_INTERVAL * (HEALTH_FAILURES + 1)
BREAKER_TIMEOUT = 5  # seconds the router keeps a failing replica out before it tries again
RESTART_BACKOFF_MAX = 30.0  # seconds: the longest wait before restarting a crashing replica
READY_POLL = 0.5  # seconds between two looks at a loading replica's /health (or the router's)
# --router-log-level: the router's Rust log reads RUST_LOG (its own --log-level loses to
# RUST_LOG, and takes "warning" for info)
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}
# vllm-router prints a few lines of its own at start-up, "DEBUG: Initializing logging" and
# the like, whatever its log level: shown only when its log is at debug
ROUTER_DEBUG_PRINT = "DEBUG: "
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # a CSI sequence: colours, bold, dim


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "replicas",
        help="serve N replicas, each on its own cores, behind vllm-router",
        description="Start N `neuronpy serve` replicas on ports PORT+1..PORT+N, each pinned to "
        "its share of this process's cores, and vllm-router on PORT in front of them. A "
        "replica that exits is started again; SIGHUP drains and restarts them one at a time "
        "(a rolling restart); SIGTERM or Ctrl-C drains them all, then stops the router. "
        "Arguments after `--` go to every `neuronpy serve`.",
    )
    parser.add_argument("-n", "--replicas", type=int, default=2, help="replicas (default 2)")
    parser.add_argument("--host", default="127.0.0.1", help="the router's address")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (8000)")
    parser.add_argument(
        "--cores-per-replica",
        type=int,
        metavar="K",
        help="cores each replica is pinned to (default: this process's cores shared out)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="cache_aware",
        help="the router's policy (default cache_aware: a request goes where the longest "
        "start of its prompt went, unless that replica is much busier; consistent_hash: by "
        "the X-Session-ID header, and every request without one to the same replica)",
    )
    parser.add_argument("--router", metavar="PATH", help="the vllm-router executable")
    parser.add_argument(
        "--router-log-level",
        choices=tuple(ROUTER_LOG_LEVELS),
        help="the router's own log (default warning: its warnings and errors; RUST_LOG, where "
        "set and this is not, is used instead); the replicas log as `neuronpy serve` does",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for vllm-router (repeat it)",
    )
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `serve` flags")


@dataclass
class Replica:
    """One `neuronpy serve` process: its port, its cores, and how often it was restarted."""

    index: int
    port: int
    cores: tuple[int, ...]
    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    failures: int = 0  # exits in a row that came soon after a start (a crash loop)
    next_start: float = 0.0
    ready: bool = False  # its /health has said 200 since its process started
    was_ready: bool = False  # ready once, in an earlier process (then a ready line says again)
    next_check: float = 0.0  # when to look at its /health again while it loads

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ)
        if self.cores:  # one thread per core it has, not per core of the machine
            threads = str(len(self.cores))
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        cores = self.cores

        def pin() -> None:
            if cores and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)

        self.process = subprocess.Popen(
            self.command,
            env=env,
            preexec_fn=pin,
            start_new_session=True,  # signals reach it from us, not from the terminal
        )
        self.started = time.monotonic()
        self.was_ready = self.was_ready or self.ready
        self.ready, self.next_check = False, 0.0
        log.info(
            "replica %d: pid %d on %s, cores %s",
            self.index,
            self.process.pid,
            self.url,
            ",".join(map(str, self.cores)) or "any",
        )

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)


@dataclass
class Supervisor:
    """The replicas and the router, and what the signals asked for."""

    replicas: list[Replica]
    router_command: list[str]
    router_url: str  # where the supervisor asks the router how many replicas it counts healthy
    router_level: str | None = None  # --router-log-level (None: RUST_LOG, else warning)
    router: subprocess.Popen[bytes] | None = None
    relay: threading.Thread | None = None  # copies the router's output to our stderr
    stopping: int = 0  # SIGTERM / Ctrl-C received (a second one aborts what runs)
    rolling: list[int] = field(default_factory=list)  # replicas left to restart (SIGHUP)
    draining: int | None = None  # the replica the rolling restart is draining now
    drained_at: int = 0  # its restart count when the rolling restart drained it
    serving: bool = False  # the router has counted every replica healthy (said once)
    next_router_check: float = 0.0

    def run(self) -> int:
        for replica in self.replicas:
            replica.start()
        env, debug = router_environment(self.router_level, os.environ)
        self.router = subprocess.Popen(
            self.router_command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.router.stdout is not None
        self.relay = threading.Thread(
            target=relay_router_output,
            args=(self.router.stdout, sys.stderr, colour(sys.stderr), debug),
            name="vllm-router output",
            daemon=True,
        )
        self.relay.start()
        log.info("vllm-router: pid %d, %s", self.router.pid, " ".join(self.router_command))
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, self._roll)
        while not self.stopping:
            if self.router.poll() is not None:
                log.error("vllm-router exited (%s): stopping the replicas", self.router.returncode)
                self._stop(signal.SIGTERM, None)
                break
            for replica in self.replicas:
                self._watch(replica)
                self._see_ready(replica)
            self._see_serving()
            self._roll_on()
            time.sleep(0.2)
        return self._shut_down()

    def _watch(self, replica: Replica) -> None:
        """Start `replica` again once it has exited: at once after a drain or a long run,
        after a growing wait when it keeps failing soon after its start."""
        process = replica.process
        now = time.monotonic()
        if process is not None and process.poll() is not None:
            code = process.returncode
            quick = now - replica.started < 60 and code != 0
            replica.failures = replica.failures + 1 if quick else 0
            delay = min(RESTART_BACKOFF_MAX, 2.0 ** (replica.failures - 1)) if quick else 0.0
            log.warning(
                "replica %d exited with %s; starting it again%s",
                replica.index,
                code,
                f" in {delay:g} s" if delay else "",
            )
            replica.process = None
            replica.next_start = now + delay
            replica.restarts += 1
        if replica.process is None and now >= replica.next_start:
            replica.start()

    def _see_ready(self, replica: Replica) -> None:
        """Say once, for each start of `replica`, that it is ready: its /health said 200 (looked
        at every READY_POLL seconds while it loads)."""
        process, now = replica.process, time.monotonic()
        if replica.ready or process is None or process.poll() is not None:
            return
        if now < replica.next_check:
            return
        if not _ready(replica.url):
            replica.next_check = now + READY_POLL
            return
        replica.ready = True
        if replica.was_ready:
            log.info(
                "replica %d ready again on %s (pid %d, restart %d)",
                replica.index,
                replica.url,
                process.pid,
                replica.restarts,
            )
        else:
            log.info(
                "replica %d ready on %s (pid %d): %d of %d ready",
                replica.index,
                replica.url,
                process.pid,
                sum(r.ready for r in self.replicas),
                len(self.replicas),
            )

    def _see_serving(self) -> None:
        """Say once that the router serves: every replica ready, and counted healthy by it."""
        now = time.monotonic()
        if self.serving or now < self.next_router_check:
            return
        if not all(r.ready for r in self.replicas):
            return
        if _healthy_workers(self.router_url) < len(self.replicas):
            self.next_router_check = now + READY_POLL
            return
        self.serving = True
        log.info(
            "vllm-router serving on %s: %d of %d replicas healthy",
            self.router_url,
            len(self.replicas),
            len(self.replicas),
        )

    def _roll_on(self) -> None:
        """The rolling restart: drain the next replica once the one before is serving again."""
        if self.draining is not None:
            replica = self.replicas[self.draining]
            if replica.restarts == self.drained_at or not replica.ready:
                return  # still draining, restarting or loading
            if _healthy_workers(self.router_url) < len(self.replicas):
                return  # serving, but the router has not taken it back yet
            log.info("rolling restart: replica %d is serving again", replica.index)
            self.draining = None
        if self.rolling:
            self.draining = self.rolling.pop(0)
            self.drained_at = self.replicas[self.draining].restarts
            log.info("rolling restart: draining replica %d", self.draining)
            self.replicas[self.draining].signal(signal.SIGTERM)

    def _roll(self, sig: int, frame: FrameType | None) -> None:
        if not self.rolling and self.draining is None:
            self.rolling = [r.index for r in self.replicas]

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        self.stopping += 1
        for replica in self.replicas:  # the first drains, the second aborts what runs
            replica.signal(signal.SIGTERM)

    def _shut_down(self) -> int:
        log.info("draining every replica, then stopping the router")
        for replica in self.replicas:
            if replica.process is not None:
                replica.process.wait()
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.router.kill()
        if self.relay is not None:  # the router's last lines, up to the end of its output
            self.relay.join(timeout=5)
        return 0


def router_environment(
    level: str | None, environ: Mapping[str, str]
) -> tuple[dict[str, str], bool]:
    """The router's environment, RUST_LOG set from `level` (--router-log-level; None: the
    environment's RUST_LOG where set, else warning), and whether its log is at debug (then its
    start-up prints are shown too)."""
    env = dict(environ)
    if level is not None or not env.get("RUST_LOG"):
        env["RUST_LOG"] = ROUTER_LOG_LEVELS[level or "warning"]
    rust_log = env["RUST_LOG"].lower()
    return env, "debug" in rust_log or "trace" in rust_log


def router_line(line: str, colours: bool, debug: bool) -> str | None:
    """One line of the router's output as shown (None: left out): its start-up prints only at
    debug, its colour codes only where `colours`."""
    if not debug and line.startswith(ROUTER_DEBUG_PRINT):
        return None
    return line if colours else ANSI.sub("", line)


def relay_router_output(source: IO[bytes], sink: TextIO, colours: bool, debug: bool) -> None:
    """Copy the router's output (`source`, until it ends) to `sink` line by line, as
    `router_line` shows it."""
    for raw in iter(source.readline, b""):
        line = router_line(raw.decode(errors="replace"), colours, debug)
        if line is not None:
            try:
                sink.write(line)
                sink.flush()
            except (OSError, ValueError):  # our own output is gone: keep draining the pipe
                pass
    source.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _healthy_workers(router: str) -> int:
    """The replicas vllm-router counts healthy (its /readiness), 0 when it does not say."""
    try:
        with urllib.request.urlopen(f"{router}/readiness", timeout=2) as response:
            return int(json.load(response).get("healthy_workers", 0))
    except (urllib.error.URLError, OSError, ValueError, TypeError, AttributeError):
        return 0


def share_cores(available: Sequence[int], replicas: int, per: int | None) -> list[tuple[int, ...]]:
    """Each replica's cores: `per` each (or an even share of `available`), in order, without
    overlap while there are enough; with fewer cores than replicas, replicas share them round
    robin. Raises ValueError for a share that cannot be given."""
    cores = sorted(available)
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    if per is None:
        per = max(1, len(cores) // replicas)
    if per < 1 or per > len(cores):
        raise ValueError(f"--cores-per-replica must be 1..{len(cores)}, got {per}")
    if per * replicas <= len(cores):
        return [tuple(cores[i * per : (i + 1) * per]) for i in range(replicas)]
    log.warning(
        "%d replicas of %d cores need %d cores, this process has %d: replicas share them",
        replicas,
        per,
        per * replicas,
        len(cores),
    )
    return [tuple(cores[(i * per + j) % len(cores)] for j in range(per)) for i in range(replicas)]


def given(args: Sequence[str], flag: str) -> bool:
    """Whether `args` set `flag` (as `--flag VALUE` or `--flag=VALUE`)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def serve_arguments(args: Sequence[str]) -> list[str]:
    """The `serve` flags given after `--`, without the `--`; the replicas' host and port are
    set here (ValueError if given)."""
    rest = list(args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    for flag in OWN_SERVE_FLAGS:
        if given(rest, flag):
            raise ValueError(f"{flag} is set per replica by `neuronpy replicas`; leave it out")
    return rest


def api_key_of(args: Sequence[str]) -> str | None:
    """The replicas' API key, where the serve flags or the environment give one: the router
    must send it to them."""
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return os.environ.get("NEURONPY_API_KEY") or None


def router_command(
    router: str, args: argparse.Namespace, replicas: Sequence[Replica], api_key: str | None
) -> list[str]:
    command = [router, "--host", args.host, "--port", str(args.port)]
    command += ["--worker-urls", *(r.url for r in replicas), "--policy", args.policy]
    # notice a drained or dead replica within seconds (its /health turns 503 or stops
    # answering), and wait as long as a first start (a model's conversion) takes
    command += ["--health-check-interval-secs", str(HEALTH_INTERVAL)]
    command += ["--health-failure-threshold", str(HEALTH_FAILURES)]
    # a replica restarted after a drain takes requests again seconds after it is ready, not
    # the minute vllm-router's circuit breaker waits by default
    command += ["--cb-timeout-duration-secs", str(BREAKER_TIMEOUT)]
    command += ["--worker-startup-timeout-secs", "1800", "--worker-startup-check-interval", "1"]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
    if api_key:
        command += ["--api-key", api_key]
    return command + list(args.router_arg)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    try:
        serve = serve_arguments(args.serve_args)
        available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if available:
            shares = share_cores(available, args.replicas, args.cores_per_replica)
        else:  # no affinity on this platform: every replica on every core
            log.warning("this platform cannot pin processes to cores: replicas share them all")
            shares = [()] * args.replicas
    except ValueError as exc:
        print(f"neuronpy: error: {exc}", file=sys.stderr)
        return 2
    router = args.router or shutil.which("vllm-router")
    if router is None:
        print(f"neuronpy: error: {ROUTER_MISSING}", file=sys.stderr)
        return 2
    replicas = []
    for i, cores in enumerate(shares):
        port = args.port + 1 + i
        command = [sys.executable, "-m", "neuronpy", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(port)]
        if not given(serve, "--drain-grace"):
            command += ["--drain-grace", str(DRAIN_GRACE)]
        replicas.append(Replica(i, port, cores, [*command, *serve]))
    command = router_command(router, args, replicas, api_key_of(serve))
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    host = f"[{host}]" if ":" in host else host
    url = f"http://{host}:{args.port}"
    supervisor = Supervisor(replicas, command, url, args.router_log_level)
    return supervisor.run()
