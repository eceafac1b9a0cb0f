"""Shared pytest configuration."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # the server runs on asyncio (uvicorn); the engine is tested on the same backend
    return "asyncio"
