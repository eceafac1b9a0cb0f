"""Shared pytest configuration."""

from __future__ import annotations

import os

import pytest

# The tests that take minutes rather than seconds, by marker: `python -m pytest` skips them and
# says how to run them; `--all` runs them too (.ci/run does), and so does a `-m` expression
# that names the marker (`python -m pytest -m soak` runs the soaks alone).
OPT_IN = {
    "slow": "loads the real default model (minutes: its layers compile on a first start)",
    "soak": "a whole-server soak (hundreds of requests, or replicas behind a router)",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): a worker per core, at most 4 (each holds ~1.5 GB: its
    fixture models, their compiled graphs, the servers it starts)."""
    return max(1, min(4, _cores()))


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "PYTEST_XDIST_WORKER" in os.environ and workers > 1:
        # each worker its share of the cores, and so each server process it starts: OpenMP
        # teams beyond the cores sleep and wake on every operation (docs/architecture.md)
        share = str(max(1, _cores() // workers))
        os.environ.setdefault("OMP_NUM_THREADS", share)
        # and the compiler its C++ in the worker's own process: a pool of compile processes
        # (inductor's default, one per core) costs each worker and server process a start-up
        # of its own, for parallelism the other workers already take
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", share)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        default=False,
        help=f"also run the tests marked {' or '.join(OPT_IN)}, which are skipped otherwise",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--all"):
        return
    named = config.getoption("markexpr") or ""
    skips = {
        marker: pytest.mark.skip(reason=f"marked {marker}: {why}; run with `pytest --all`")
        for marker, why in OPT_IN.items()
        if marker not in named
    }
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
                break


@pytest.fixture(autouse=True)
def _seeded_torch() -> None:
    """torch's global generator seeded before each test: a test's unseeded draws (torch.randn)
    are the same whatever ran before it in its worker, so a tolerance holds or fails alike in
    every order."""
    import torch

    torch.manual_seed(0)


@pytest.fixture
def anyio_backend() -> str:
    # the server runs on asyncio (uvicorn); the engine is tested on the same backend
    return "asyncio"
