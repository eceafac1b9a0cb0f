"""One model's engine in a process of its own: the server's side starts it and gets an
EngineClient (engine/remote.py); the process loads the model as the server would in its own
process (compose.load_engine), then serves the engine over a socket pair (engine/host.py).

    start_engine_process(name, spec)   # blocking: returns once the model is loaded
    python -m neuronpy.engine_process FD PARENT_PID   # the process itself (started by the above)
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import anyio

from neuronpy.compose import load_engine
from neuronpy.config import ModelSpec
from neuronpy.engine.channel import Channel, receive_blocking, send_blocking
from neuronpy.engine.engine import Engine
from neuronpy.engine.host import EngineHost
from neuronpy.engine.remote import EngineClient
from neuronpy.engine.wire import Failed, Ready
from neuronpy.errors import ModelLoadError
from neuronpy.threads import start_in_own_thread

log = logging.getLogger(__name__)

ORPHAN_POLL_SECONDS = 1.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class Setup:
    """What the engine process is to serve: the model's name and spec, and how to log."""

    name: str
    spec: ModelSpec
    log_level: int


_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.Lock()


@atexit.register
def _kill_orphans() -> None:
    """An engine process still loading when the server exits is not waited for."""
    with _live_lock:
        for process in _live:
            if process.poll() is None:
                process.kill()


def start_engine_process(name: str, spec: ModelSpec) -> EngineClient:
    """Starts model `name`'s engine process and waits until it has loaded the model and
    started its engine (blocking: the server calls it on a thread of its own, as it calls
    load_engine). Raises what the load raised, or ModelLoadError when the process ends
    before it has said."""
    ours, theirs = socket.socketpair()
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "neuronpy.engine_process",
                str(theirs.fileno()),
                str(os.getpid()),
            ],
            pass_fds=(theirs.fileno(),),
        )
    finally:
        theirs.close()
    with _live_lock:
        _live.add(process)
    try:
        send_blocking(ours, Setup(name, spec, logging.getLogger().getEffectiveLevel()))
        answer = receive_blocking(ours)
    except (EOFError, OSError):
        code = process.wait()
        ours.close()
        raise ModelLoadError(
            f"the engine process of model {name!r} ended while loading it (exit code {code})"
        ) from None
    except BaseException:
        process.kill()
        ours.close()
        raise
    finally:
        with _live_lock:
            _live.discard(process)
    if isinstance(answer, Failed):
        process.wait()
        ours.close()
        raise answer.error
    assert isinstance(answer, Ready)
    log.info("%s: its engine runs in process %d", name, process.pid)
    return EngineClient(
        answer.info, answer.tokenizer, answer.status, ours, process, processor=answer.processor
    )


async def _serve(engine: Engine, sock: socket.socket) -> None:
    channel = await Channel.open(sock)
    async with engine:
        host = EngineHost(engine, channel)
        channel.send(Ready(engine.info(), engine.tokenizer, host.status(), engine.processor))
        await host.serve()
    await channel.drain()
    channel.close()


def _end_with(parent: int) -> None:
    """Ends this process once the server's process `parent` has gone, however it went (a
    SIGKILL runs none of its exit handlers): a model loading or compiling here would not
    notice the channel's end until it is done."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="neuronpy-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    _end_with(int(argv[1]))
    setup: Setup = receive_blocking(sock)
    logging.basicConfig(level=setup.log_level, format=LOG_FORMAT, stream=sys.stderr)
    # Ctrl-C reaches every process of the terminal's group, and a service manager's SIGTERM
    # may reach every process of the service: the server's process drains this one and then
    # closes it itself (and should that process be killed, this one ends with it: _end_with)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        # on a thread that ends with the load, as the server loads in its own process (see
        # threads.run_in_own_thread): a thread that ran tensor operations keeps an OpenMP team
        # while it lives, and with more teams than cores every operation of the device
        # worker's waits for its team to wake (measured here: every step 1.5x slower)
        future, thread = start_in_own_thread(
            lambda: load_engine(setup.name, setup.spec), f"neuronpy-load-{setup.name}"
        )
        thread.join()
        engine = future.result()
    except BaseException as exc:
        try:
            send_blocking(sock, Failed(exc))
        except Exception:
            send_blocking(sock, Failed(ModelLoadError(f"{type(exc).__name__}: {exc}")))
        return 1
    anyio.run(_serve, engine, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
