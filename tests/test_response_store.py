"""The Responses API's store on real servers on loopback: a follow-up sent to another model
than its previous response's replays the conversation there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.servers import RunningServer, fixture_model, run_server

MODEL = "tiny-llama"
OTHER = "tiny-qwen3"  # other weights: a session of MODEL's is not for it


@pytest.fixture(scope="module")
def sessions_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def server(sessions_dir: Path) -> Iterator[RunningServer]:
    models = {**fixture_model(MODEL), **fixture_model(OTHER)}
    with run_server(models, sessions_dir=sessions_dir) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


# ---- follow-ups across models -------------------------------------------------------------------


def test_a_follow_up_on_another_model_replays_the_conversation_there(
    server: RunningServer,
) -> None:
    """previous_response_id names a response of MODEL, whose KV (a session file of MODEL's)
    is no use to OTHER: the follow-up on OTHER prefills the conversation, writing what a replay
    on OTHER writes, as it does without --sessions-dir; and continues back on MODEL as well."""
    api = client(server)
    kwargs: dict[str, Any] = dict(max_output_tokens=8, temperature=0.0)
    first = api.responses.create(model=MODEL, input="Tell me a story", **kwargs)
    follow = api.responses.create(
        model=OTHER, input="And then?", previous_response_id=first.id, **kwargs
    )
    replay = api.responses.create(
        model=OTHER,
        input=[
            {"role": "user", "content": "Tell me a story"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "And then?"},
        ],
        store=False,
        **kwargs,
    )
    assert follow.model == OTHER and follow.output_text == replay.output_text
    assert follow.usage.input_tokens == replay.usage.input_tokens
    back = api.responses.create(
        model=MODEL, input="The end.", previous_response_id=follow.id, **kwargs
    )
    assert back.status in ("completed", "incomplete") and back.previous_response_id == follow.id
