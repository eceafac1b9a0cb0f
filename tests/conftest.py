"""Shared pytest configuration."""

from __future__ import annotations

import pytest

# The tests that take minutes rather than seconds, by marker: `python -m pytest` skips them and
# says how to run them; `--all` runs them too (.ci/run does), and so does a `-m` expression
# that names the marker (`python -m pytest -m soak` runs the soaks alone).
OPT_IN = {
    "slow": "loads the real default model (minutes: its layers compile on a first start)",
    "soak": "a whole-server soak (server processes, replicas behind a router)",
}


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


@pytest.fixture
def anyio_backend() -> str:
    # the server runs on asyncio (uvicorn); the engine is tested on the same backend
    return "asyncio"
