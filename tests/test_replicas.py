"""Running behind a router: liveness beside readiness, the load vllm-router polls, the drain an
operator (or a rolling restart) asks for over HTTP, vLLM's metric names, and the session header
a router's affinity hashes on, sessions shared by replicas through one directory. On real
servers on loopback (the router itself: tests/test_router.py)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from neuronpy.cli import QuietProbes, build_parser, config_from_args
from neuronpy.engine.engine import Engine
from neuronpy.envflags import colour
from neuronpy.replicas import (
    api_key_of,
    relay_router_output,
    router_environment,
    router_line,
    serve_arguments,
    share_cores,
)
from neuronpy.server.errors import ApiError
from neuronpy.server.metrics_collector import VLLM_ALSO, VLLM_LABELS, VLLM_NAMES
from neuronpy.server.replica import drain
from tests.scripted import hold_plans, wait_for
from tests.servers import TINY_LLAMA, RunningServer, engine_loader, run_server

MODEL = "tiny-llama"
KEY = "replica-test-key"


class Gate:
    """Holds every plan of an engine that samples tokens while closed (its loop awaits): the
    requests in the batch stay running, those behind them waiting, for as long as a test
    needs to look at them. Open until `close()` (the start-up warm-up samples too)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def loader(self, **config: Any) -> dict[str, Callable[[], Engine]]:
        load = engine_loader(**config)

        def gated() -> Engine:
            engine = load()

            async def held(rows: Sequence[Any]) -> None:
                await wait_for(self._open, 120)

            hold_plans(engine, held)
            return engine

        return {MODEL: gated}


def chat(turn: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": turn}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


@pytest.fixture()
def gated() -> Iterator[tuple[RunningServer, Gate]]:
    gate = Gate()
    with run_server(gate.loader(max_in_flight=2, max_queue=8), api_key=KEY) as server:
        try:
            yield server, gate
        finally:
            gate.open()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


Finish = tuple[int, list[str]]  # a stream's status code, and its lines with a finish reason


def start_streams(
    server: RunningServer, count: int, finishes: list[Finish]
) -> list[threading.Thread]:
    """`count` streamed chat requests on threads, each adding its Finish to `finishes`."""
    threads = []
    for i in range(count):

        def run(i: int = i) -> None:
            body = chat(f"request {i}", max_tokens=4, ignore_eos=True, stream=True)
            with httpx.stream(
                "POST", f"{server.v1}/chat/completions", json=body, headers=auth(), timeout=120
            ) as response:
                finished = [line for line in response.iter_lines() if '"finish_reason":"' in line]
                finishes.append((response.status_code, finished))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
    return threads


def wait_for_load(
    server: RunningServer, predicate: Callable[[dict[str, int]], bool], timeout: float = 60
) -> dict[str, Any]:
    """Poll /get_load (it needs no key) until the model's counts satisfy `predicate`."""
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(f"{server.url}/get_load", timeout=10).json()
        if predicate(load["models"][MODEL]):
            return load
        assert time.monotonic() < deadline, f"the load never got there: {load}"
        time.sleep(0.02)


def test_live_and_get_load_need_no_key_and_count_what_the_engine_holds(
    gated: tuple[RunningServer, Gate],
) -> None:
    server, gate = gated
    assert httpx.get(f"{server.url}/live", timeout=10).json() == {"status": "alive"}
    idle = httpx.get(f"{server.url}/get_load", timeout=10)
    assert idle.status_code == 200
    assert idle.json() == {
        "load": 0,
        "status": "ok",
        "models": {MODEL: {"running": 0, "waiting": 0}},
    }
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401  # still keyed
    gate.close()
    finishes: list[Finish] = []
    # held at their first token: in the batch, or (the worker being held) waiting for a row
    threads = start_streams(server, 3, finishes)
    held = wait_for_load(server, lambda m: m["running"] + m["waiting"] == 3)
    assert held["load"] == 3 and held["models"][MODEL]["running"] >= 1
    gate.open()
    for thread in threads:
        thread.join(timeout=120)
    assert [code for code, _ in finishes] == [200, 200, 200]


def test_post_drain_turns_unready_refuses_new_requests_and_lets_admitted_ones_finish(
    gated: tuple[RunningServer, Gate],
) -> None:
    server, gate = gated
    assert httpx.post(f"{server.url}/drain", timeout=10).status_code == 401  # keyed
    gate.close()
    finishes: list[Finish] = []
    threads = start_streams(server, 2, finishes)
    wait_for_load(server, lambda m: m["running"] + m["waiting"] == 2)
    first = httpx.post(f"{server.url}/drain", headers=auth(), timeout=10)
    assert first.status_code == 202
    assert first.json()["status"] == "draining" and first.json()["load"] == 2
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "stopping"
    assert httpx.get(f"{server.url}/live", timeout=10).status_code == 200  # alive all along
    refused = httpx.post(f"{server.v1}/chat/completions", json=chat("late"), headers=auth())
    assert refused.status_code == 503  # a router retries it on another replica
    # asked again (a retried call): still draining, nothing aborted
    again = httpx.post(f"{server.url}/drain", headers=auth(), timeout=10)
    assert again.status_code == 202
    gate.open()
    for thread in threads:
        thread.join(timeout=120)
    assert [code for code, _ in finishes] == [200, 200]
    assert all(any('"finish_reason":"length"' in line for line in lines) for _, lines in finishes)


def _request(client: tuple[str, int] | None) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/drain", "headers": [], "client": client}
    return Request(scope)


@pytest.mark.anyio
async def test_drain_without_an_api_key_is_taken_from_loopback_only() -> None:
    from neuronpy.server.models import ServedModel, ServerState

    state = ServerState({MODEL: ServedModel(MODEL, lambda: None)})  # type: ignore[arg-type,return-value]
    for remote in (("10.1.2.3", 4000), ("2001:db8::1", 4000), None):
        with pytest.raises(ApiError) as refused:
            await drain(_request(remote), state, api_key=None)
        assert refused.value.status == 403 and "loopback" in refused.value.message
    with pytest.raises(ApiError) as idle:  # from loopback: allowed, but nothing runs here
        await drain(_request(("127.0.0.1", 4000)), state, api_key=None)
    assert idle.value.status == 503


def _families(text: str) -> dict[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    families: dict[str, dict[tuple[str, frozenset[tuple[str, str]]], float]] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return families


def test_metrics_carry_vllms_names_with_the_same_values() -> None:
    with run_server({MODEL: engine_loader(max_in_flight=2)}) as server:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        for turn in ("one", "two", "three"):
            client.chat.completions.create(**chat(turn))
        families = _families(httpx.get(f"{server.url}/metrics", timeout=10).text)
    for ours, theirs in VLLM_NAMES.items():
        for name in (theirs, *VLLM_ALSO.get(theirs, ())):
            ours_family = families[ours.removesuffix("_total")]
            expected = {
                (
                    name + sample[len(ours) :],
                    frozenset((VLLM_LABELS.get(k, k), v) for k, v in labels),
                ): value
                for (sample, labels), value in ours_family.items()
            }
            assert families[name] == expected, name
            assert expected, f"{ours} has no samples"
    success = families["vllm:request_success"]
    assert (
        success[
            "vllm:request_success_total",
            frozenset({("model_name", MODEL), ("finished_reason", "length")}),
        ]
        == 3
    )
    assert families["vllm:num_requests_running"] == {
        ("vllm:num_requests_running", frozenset({("model_name", MODEL)})): 0.0
    }


# ---- the session header -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, ...]]:
    """Two servers (two replicas) sharing one sessions directory."""
    directory = tmp_path_factory.mktemp("sessions")
    with (
        run_server({MODEL: engine_loader()}, sessions_dir=directory) as first,
        run_server({MODEL: engine_loader()}, sessions_dir=directory) as second,
    ):
        first.directory = directory  # type: ignore[attr-defined]
        yield first, second


def _ask(server: RunningServer, messages: list[dict[str, str]], **headers: str) -> Any:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_headers=headers
    )


def test_a_session_header_saves_the_conversation_and_another_replica_continues_it(
    sharing: tuple[RunningServer, ...],
) -> None:
    first, second = sharing
    directory: Path = first.directory  # type: ignore[attr-defined]
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    turn = _ask(first, messages, **{"X-Session-ID": "conv-7f3a"}).parse()
    assert turn.usage.prompt_tokens_details.cached_tokens == 0
    assert (directory / "conv-7f3a.safetensors").is_file()
    messages += [
        {"role": "assistant", "content": turn.choices[0].message.content},
        {"role": "user", "content": "Which is the longest?"},
    ]
    restored = second.stats()["sessions_restored"]
    again = _ask(second, messages, **{"X-Session-ID": "conv-7f3a"}).parse()
    # the second replica never saw the first turn: it came from the file the first one saved
    assert again.usage.prompt_tokens_details.cached_tokens >= turn.usage.prompt_tokens
    assert second.stats()["sessions_restored"] == restored + 1


def test_a_body_session_wins_over_the_header_and_a_bad_header_is_a_400_naming_it(
    sharing: tuple[RunningServer, ...],
) -> None:
    first, _ = sharing
    directory: Path = first.directory  # type: ignore[attr-defined]
    body = chat("hello", session="from-body")
    response = httpx.post(
        f"{first.v1}/chat/completions", json=body, headers={"X-Session-ID": "from-header"}
    )
    assert response.status_code == 200
    assert (directory / "from-body.safetensors").is_file()
    assert not (directory / "from-header.safetensors").exists()
    bad = httpx.post(
        f"{first.v1}/chat/completions", json=chat("hello"), headers={"X-Session-ID": "../x"}
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-session-id"
    # n > 1 cannot have a session: the header is then only the router's key
    many = httpx.post(
        f"{first.v1}/chat/completions",
        json=chat("hello", n=2),
        headers={"X-Session-ID": "many-choices"},
    )
    assert many.status_code == 200 and len(many.json()["choices"]) == 2
    assert not (directory / "many-choices.safetensors").exists()


def test_the_session_header_can_be_turned_off(tmp_path: Path) -> None:
    with run_server({MODEL: engine_loader()}, sessions_dir=tmp_path, session_header=None) as s:
        response = httpx.post(
            f"{s.v1}/chat/completions", json=chat("hello"), headers={"X-Session-ID": "off"}
        )
        assert response.status_code == 200
    assert not list(tmp_path.glob("*.safetensors"))


# ---- the launcher's pieces ----------------------------------------------------------------------


def test_cores_are_shared_out_without_overlap_while_there_are_enough() -> None:
    assert share_cores([0, 1], 2, None) == [(0,), (1,)]
    assert share_cores([3, 1, 2, 0], 2, None) == [(0, 1), (2, 3)]
    assert share_cores([0, 1, 2, 3], 2, 1) == [(0,), (1,)]
    assert share_cores([0, 1], 3, None) == [(0,), (1,), (0,)]  # more replicas than cores
    with pytest.raises(ValueError, match="cores-per-replica"):
        share_cores([0, 1], 2, 3)
    with pytest.raises(ValueError, match="at least 1"):
        share_cores([0, 1], 0, None)


def test_serve_arguments_pass_through_but_host_and_port_are_the_launchers() -> None:
    assert serve_arguments(["--", "--model", "m", "--api-key=k"]) == ["--model", "m", "--api-key=k"]
    assert api_key_of(["--model", "m", "--api-key=k"]) == "k"
    assert api_key_of(["--api-key", "k2"]) == "k2"
    for flag in (["--port", "9"], ["--host=0.0.0.0"]):
        with pytest.raises(ValueError, match="per replica"):
            serve_arguments(["--", *flag])


def test_a_drains_grace_admits_requests_while_health_already_says_503() -> None:
    with run_server({MODEL: engine_loader()}, drain_grace=600.0) as server:
        assert httpx.post(f"{server.url}/drain", timeout=10).status_code == 202
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        assert health.json() == {"status": "stopping", "models": {MODEL: "stopping"}}
        assert httpx.get(f"{server.url}/health", params={"model": MODEL}).status_code == 503
        # a router that has not seen the 503 yet still gets its request served
        served = httpx.post(f"{server.v1}/chat/completions", json=chat("in the grace"))
        assert served.status_code == 200
        assert served.json()["choices"][0]["finish_reason"] in ("stop", "length")
        server.state.request_shutdown()  # the second request cuts the grace short
        deadline = time.monotonic() + 60
        while (
            late := httpx.post(f"{server.v1}/chat/completions", json=chat("late"))
        ).status_code == 200:
            assert time.monotonic() < deadline, "the grace was never cut short"
            time.sleep(0.05)
        assert late.status_code == 503


# ---- what the servers print ---------------------------------------------------------------------


def test_colours_only_on_a_terminal_and_never_with_no_color() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert colour(Terminal(), {}) and colour(Terminal(), {"NO_COLOR": ""})
    assert not colour(Terminal(), {"NO_COLOR": "1"})
    assert not colour(io.StringIO(), {}) and not colour(object(), {})


def _access(path: str, status: int) -> logging.LogRecord:
    args = ("127.0.0.1:5000", "GET", path, "1.1", status)
    return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "%s %s %s %s %d", args, None)


def test_health_503s_stay_out_of_the_access_log_only_while_loading_or_draining() -> None:
    from neuronpy.server.models import ServedModel, ServerState

    model = ServedModel(MODEL, lambda: None)  # type: ignore[arg-type,return-value]
    state = ServerState({MODEL: model})
    quiet = QuietProbes(lambda: state.settling)
    assert model.status == "loading" and state.settling
    assert not quiet.filter(_access("/health", 503))
    assert not quiet.filter(_access("/health?model=tiny-llama", 503))
    assert not quiet.filter(_access("/health", 200))
    assert quiet.filter(_access("/v1/chat/completions", 503))  # a refused request: logged
    model.status = "stopping"
    assert not quiet.filter(_access("/health", 503))
    model.status = "failed"  # a real error: each check says so
    assert not state.settling and quiet.filter(_access("/health", 503))
    assert QuietProbes().filter(_access("/health", 503))  # told nothing: every failure logged


# ---- what the launcher prints -------------------------------------------------------------------


def test_the_routers_log_is_at_warning_unless_asked_and_rust_log_is_kept_where_set() -> None:
    env, debug = router_environment(None, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "RUST_LOG": "warn"} and not debug
    assert router_environment("info", {})[0]["RUST_LOG"] == "info"
    assert router_environment("debug", {}) == ({"RUST_LOG": "debug"}, True)
    # the environment's own RUST_LOG wins over the default, never over the flag
    assert router_environment(None, {"RUST_LOG": "vllm_router_rs=debug"})[1]
    assert router_environment("error", {"RUST_LOG": "debug"}) == ({"RUST_LOG": "error"}, False)
    assert router_environment(None, {"RUST_LOG": ""})[0]["RUST_LOG"] == "warn"
    parser = build_parser()
    assert parser.parse_args(["replicas"]).router_log_level is None
    assert parser.parse_args(["replicas", "--router-log-level", "info"]).router_log_level == "info"


COLOURED = (
    "\x1b[2m2026-01-01 00:00:00\x1b[0m \x1b[33m WARN\x1b[0m \x1b[2mvllm_router_rs::server\x1b[0m"
    "\x1b[2m:\x1b[0m worker unhealthy\n"
)


def test_the_routers_lines_lose_their_colours_and_its_start_up_prints_unless_asked() -> None:
    plain = "2026-01-01 00:00:00  WARN vllm_router_rs::server: worker unhealthy\n"
    assert router_line(COLOURED, colours=False, debug=False) == plain
    assert router_line(COLOURED, colours=True, debug=False) == COLOURED
    assert router_line("DEBUG: Initializing logging\n", colours=False, debug=False) is None
    assert (
        router_line("DEBUG: Initializing logging\n", False, True) == "DEBUG: Initializing logging\n"
    )
    traceback = "Error starting router: Timeout 2s waiting for hosts\n"  # its errors stay
    assert router_line(traceback, colours=False, debug=False) == traceback
    out = io.StringIO()
    source = io.BytesIO(f"DEBUG: Logging initialized\n{COLOURED}{traceback}".encode())
    relay_router_output(source, out, colours=False, debug=False)
    assert out.getvalue() == plain + traceback


def _free_ports(count: int) -> int:
    """A port such that it and the `count - 1` after it are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError("no run of free ports")


def _text(log: Path) -> str:
    return log.read_text(errors="replace")


def _wait_for(
    what: str, done: Callable[[], bool], process: subprocess.Popen[bytes], log: Path
) -> None:
    """Until `done()` (a generous deadline: the replicas compile their model first)."""
    deadline = time.monotonic() + 600
    while not done():
        assert process.poll() is None, _text(log)[-4000:]
        assert time.monotonic() < deadline, f"never: {what}\n" + _text(log)[-4000:]
        time.sleep(0.2)


def _healthy(router: str) -> int:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return int(httpx.get(f"{router}/readiness", timeout=5).json().get("healthy_workers", 0))
    return -1


@pytest.mark.soak  # two replica processes behind the router, drained (test_router.py's fleet)
@pytest.mark.skipif(
    shutil.which("vllm-router") is None,
    reason="vllm-router is not installed (pip install vllm-router: Linux x86-64 wheels only)",
)
def test_neuronpy_replicas_prints_a_line_per_replica_ready_no_colours_no_debug_no_503s(
    tmp_path: Path,
) -> None:
    """The real launcher, its output in a file: the router's log at warning without its
    start-up prints or colour codes, one line per replica when it is ready, and none of the
    /health 503s the router's checks (and the launcher's own) get while the replicas load
    and while they drain."""
    port, log = _free_ports(3), tmp_path / "replicas.log"
    router, replicas = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
    command = [sys.executable, "-m", "neuronpy", "replicas", "-n", "2", "--port", str(port)]
    # a drain's grace long enough to see its 503s for sure; a second SIGTERM cuts it short
    command += ["--", "--model", str(TINY_LLAMA), "--drain-grace", "600"]
    root = Path(__file__).resolve().parent.parent
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for("serving", lambda: "vllm-router serving on" in _text(log), process, log)
        process.send_signal(signal.SIGTERM)  # the replicas turn unready, for the grace
        _wait_for(
            "both unready",
            lambda: _text(log).count("stopping: unready now") == 2,
            process,
            log,
        )
        assert [httpx.get(f"{url}/health", timeout=10).status_code for url in replicas] == [
            503,
            503,
        ]
        # the router's own checks got 503s until it counted neither replica healthy
        _wait_for("the router sees the drain", lambda: _healthy(router) == 0, process, log)
        process.send_signal(signal.SIGTERM)  # the grace cut short: they drain and exit
        assert process.wait(timeout=300) == 0
    finally:
        if process.poll() is None:  # failed midway: the replicas and the router go too
            children = psutil.Process(process.pid).children(recursive=True)
            process.kill()
            process.wait()
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
    text = _text(log)
    lines = text.splitlines()
    assert "\x1b[" not in text
    assert [line for line in lines if re.search(r"\bDEBUG\b", line)] == []
    assert [line for line in lines if "GET /health" in line] == []  # 200s and 503s alike
    assert "Loading weights" not in text  # (no progress bar redrawn into a file)
    assert [line for line in lines if "vllm_router_rs" in line and " INFO " in line] == []
    ready = re.findall(r"replica (\d) ready on (\S+) \(pid \d+\): (\d) of 2 ready$", text, re.M)
    assert sorted(index for index, _, _ in ready) == ["0", "1"], text[-4000:]
    assert {replicas[int(index)] == url for index, url, _ in ready} == {True}
    assert [count for _, _, count in ready] == ["1", "2"]
    assert text.count("ready again") == 0
    assert text.count(f"vllm-router serving on {router}: 2 of 2 replicas healthy") == 1


# ---- the Kubernetes example ---------------------------------------------------------------------


def test_the_kubernetes_example_is_valid_and_its_drain_fits_the_grace_period() -> None:
    docs = list(
        yaml.safe_load_all((Path(__file__).parent.parent / "docs" / "kubernetes.yaml").read_text())
    )
    by_kind: dict[tuple[str, str], dict[str, Any]] = {
        (d["kind"], d["metadata"]["name"]): d for d in docs
    }
    assert all(d.get("apiVersion") for d in docs)
    server = by_kind["Deployment", "neuronpy"]
    pod = server["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    # the arguments are real `neuronpy serve` flags, and the drain fits in the grace period
    config = config_from_args(build_parser().parse_args(container["args"]))
    drain = config.server.drain_grace + config.server.drain_timeout
    assert pod["terminationGracePeriodSeconds"] > drain
    assert config.server.port == container["ports"][0]["containerPort"]
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert server["spec"]["selector"]["matchLabels"] == labels
    assert by_kind["Service", "neuronpy"]["spec"]["selector"] == labels
    router = by_kind["Deployment", "neuronpy-router"]["spec"]["template"]["spec"]
    (command,) = router["containers"][0]["args"]
    selector = " ".join(f"{k}={v}" for k, v in labels.items())
    assert f"--selector {selector}" in command and "--policy cache_aware" in command
    assert (
        router["serviceAccountName"]
        == by_kind["RoleBinding", "neuronpy-router"]["subjects"][0]["name"]
    )
    claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert by_kind["PersistentVolumeClaim", claim]["spec"]["accessModes"] == ["ReadWriteMany"]
