"""The API key, CORS and what the server never reveals, against real servers on loopback."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from neuronpy.cli import build_parser, config_from_args
from neuronpy.config import ServerConfig, load_config
from neuronpy.server.app import create_app
from tests.servers import RunningServer, fixture_model, run_server

KEY = "np-test-3f9c1e0b7d2a4c58a1e6"
ORIGIN = "https://a.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT_BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT_BODY = {"prompt": "Hi", "max_tokens": 2}
# Every route but /health, and one that does not exist: (method, path, body)
PROTECTED: list[tuple[str, str, dict[str, object] | None]] = [
    ("POST", "/v1/chat/completions", CHAT_BODY),
    ("POST", "/v1/completions", TEXT_BODY),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny-llama", None),
    ("GET", "/stats", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/nothing-here", None),
]
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


@pytest.fixture(scope="module")
def secured() -> Iterator[RunningServer]:
    """The tiny Llama behind a key, with CORS on for one origin."""
    with run_server(fixture_model(), api_key=KEY, cors_allow_origins=[ORIGIN]) as running:
        yield running


@pytest.fixture(scope="module")
def plain() -> Iterator[RunningServer]:
    """The defaults: no key, no CORS."""
    with run_server(fixture_model()) as running:
        yield running


def request(
    server: RunningServer, method: str, path: str, body: object = None, **headers: str
) -> httpx.Response:
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)


def check_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key" and error["param"] is None
    assert KEY not in response.text


def raw(server: RunningServer, head: bytes) -> bytes:
    """Send a raw HTTP/1.1 request head; the response's status line and headers."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        response = b""
        while b"\r\n\r\n" not in response and (chunk := sock.recv(65536)):
            response += chunk
    return response


# ---- the API key --------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_missing_or_wrong_key_is_401_everywhere_but_health(secured, method, path, body) -> None:
    check_401(request(secured, method, path, body))
    for wrong in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", f"Basic {KEY}", KEY):
        check_401(request(secured, method, path, body, Authorization=wrong))
    check_401(request(secured, method, path, body, **{"x-api-key": "nope"}))


def test_missing_and_wrong_keys_say_which(secured: RunningServer) -> None:
    missing = request(secured, "GET", "/v1/models").json()["error"]["message"]
    wrong = request(secured, "GET", "/v1/models", Authorization="Bearer nope").json()
    assert "no API key" in missing and wrong["error"]["message"] == "invalid API key"


def test_health_is_open(secured: RunningServer) -> None:
    assert secured.health().status_code == 200
    assert request(secured, "GET", "/health?model=tiny-llama").status_code == 200


def test_right_key_opens_every_route(secured: RunningServer) -> None:
    for method, path, body in PROTECTED:
        response = request(secured, method, path, body, **AUTH)
        expected = 404 if path == "/v1/nothing-here" else 200
        assert response.status_code == expected, (path, response.text)
    lower = request(secured, "GET", "/v1/models", Authorization=f"bearer  {KEY}")
    assert lower.status_code == 200
    assert request(secured, "GET", "/stats", **{"x-api-key": KEY}).status_code == 200


def test_openai_client_with_and_without_the_key(secured: RunningServer) -> None:
    api = openai.OpenAI(base_url=secured.v1, api_key=KEY, max_retries=0, timeout=60)
    out = api.chat.completions.create(model="tiny-llama", **CHAT_BODY)  # type: ignore[arg-type]
    assert out.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in api.models.list()] == ["tiny-llama"]
    stream = api.completions.create(model="tiny-llama", prompt="Hi", max_tokens=3, stream=True)
    assert list(stream)[-1].choices[0].finish_reason in ("stop", "length")
    wrong = openai.OpenAI(base_url=secured.v1, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as raised:
        wrong.chat.completions.create(model="tiny-llama", **CHAT_BODY)  # type: ignore[arg-type]
    assert raised.value.status_code == 401
    assert raised.value.code == "invalid_api_key"


@pytest.mark.parametrize(
    "head",
    [
        b"GET http://evil.example/v1/models HTTP/1.1\r\nHost: evil.example\r\n",
        b"GET http://127.0.0.1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1/health\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Forwarded-Host: x/health\r\n"
        b"X-Original-URL: /health\r\nX-Forwarded-Prefix: /health\r\n",
        b"GET http://x/health/../stats HTTP/1.1\r\nHost: x\r\n",
        b"GET /health/../stats HTTP/1.1\r\nHost: x\r\n",
        b"GET //health HTTP/1.1\r\nHost: x\r\n",
        b"GET /stats?/health HTTP/1.1\r\nHost: x\r\n",
        b"GET /stats;/health HTTP/1.1\r\nHost: x\r\n",
        b"GET http://x/health HTTP/1.1\r\nHost: x\r\n",  # uvicorn's path: "http://x/health"
    ],
    ids=[
        "absolute-form",
        "absolute-form-loopback",
        "host-x",
        "host-with-path",
        "forwarding-headers",
        "absolute-dot-segments",
        "dot-segments",
        "double-slash",
        "query",
        "path-parameter",
        "absolute-form-health",
    ],
)
def test_crafted_requests_cannot_bypass_the_key(secured: RunningServer, head: bytes) -> None:
    """Only the scope's path, exactly /health, is open: not a Host header, not a full URL."""
    response = raw(secured, head + b"Connection: close\r\n\r\n")
    assert response.split(b"\r\n", 1)[0] == b"HTTP/1.1 401 Unauthorized", response
    assert b"www-authenticate: bearer" in response.lower()


def test_key_never_in_logs_or_responses(
    secured: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    saved = {name: logging.getLogger(name).level for name in UVICORN_LOGGERS}
    for name in UVICORN_LOGGERS:  # uvicorn's loggers do not propagate: listen to them directly
        logging.getLogger(name).addHandler(caplog.handler)
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        responses = [
            request(secured, "GET", "/v1/models", Authorization=f"Bearer {KEY}-wrong"),
            request(secured, "GET", "/v1/models", **{"x-api-key": KEY[:-2]}),
            request(secured, "POST", "/v1/completions", {"prompt": ""}, **AUTH),  # a 400
            request(secured, "POST", "/v1/completions", {"prompt": [10**9]}, **AUTH),
            request(secured, "POST", "/v1/completions", TEXT_BODY, **AUTH),
            request(secured, "GET", "/stats", **AUTH),
            request(secured, "GET", "/metrics", **AUTH),
        ]
    finally:
        for name in UVICORN_LOGGERS:
            logging.getLogger(name).removeHandler(caplog.handler)
            logging.getLogger(name).setLevel(saved[name])
    assert any("GET /v1/models" in r.getMessage() for r in caplog.records)  # the access log ran
    assert all(KEY not in record.getMessage() for record in caplog.records)
    assert KEY not in caplog.text
    for response in responses:
        assert KEY not in response.text and KEY not in str(response.headers)


def test_config_never_prints_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURONPY_API_KEY", KEY)
    config = load_config()
    assert config.server.api_key == KEY
    assert KEY not in repr(config) and KEY not in str(config.server)
    with pytest.raises(ValueError) as raised:
        ServerConfig(api_key="a key with spaces")
    assert "a key with spaces" not in str(raised.value) and "api_key" in str(raised.value)
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="")


def test_api_key_flag_over_file_over_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "neuronpy.toml"
    path.write_text('[server]\napi_key = "from-file"\n')

    def key(*argv: str) -> str | None:
        return config_from_args(build_parser().parse_args(["serve", *argv])).server.api_key

    monkeypatch.setenv("NEURONPY_API_KEY", "from-env")
    assert key() == "from-env"
    assert key("--config", str(path)) == "from-file"
    assert key("--config", str(path), "--api-key", "from-flag") == "from-flag"
    monkeypatch.setenv("NEURONPY_API_KEY", "")
    assert key() is None
    monkeypatch.delenv("NEURONPY_API_KEY")
    assert load_config(environ={"NEURONPY_API_KEY": "given"}).server.api_key == "given"


# ---- CORS ---------------------------------------------------------------------------------------


def preflight(server: RunningServer, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang",
    }
    return httpx.options(f"{server.v1}/chat/completions", headers=headers, timeout=30)


def test_cors_is_off_by_default(plain: RunningServer) -> None:
    simple = request(plain, "GET", "/v1/models", Origin=ORIGIN)
    assert simple.status_code == 200
    assert "access-control-allow-origin" not in simple.headers
    assert "access-control-allow-origin" not in preflight(plain, ORIGIN).headers
    # and without a key nothing is asked for (the defaults), /metrics included
    assert request(plain, "GET", "/metrics").status_code == 200


def test_cors_preflight_needs_no_key_but_the_request_does(secured: RunningServer) -> None:
    allowed = preflight(secured, ORIGIN)
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in allowed.headers
    refused = preflight(secured, "https://evil.example")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    # the actual request: 401 without the key (readable by the page), 200 with it
    without = request(secured, "POST", "/v1/chat/completions", CHAT_BODY, Origin=ORIGIN)
    check_401(without)
    assert without.headers["access-control-allow-origin"] == ORIGIN
    served = request(secured, "POST", "/v1/chat/completions", CHAT_BODY, Origin=ORIGIN, **AUTH)
    assert served.status_code == 200
    assert served.headers["access-control-allow-origin"] == ORIGIN
    other = request(secured, "GET", "/v1/models", Origin="https://evil.example", **AUTH)
    assert "access-control-allow-origin" not in other.headers
    # an OPTIONS that is not a preflight is an ordinary request: it needs the key
    check_401(httpx.options(f"{secured.v1}/models", headers={"Origin": ORIGIN}))


def test_cors_wildcard_with_credentials_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "neuronpy.toml"
    path.write_text('[server]\ncors_allow_origins = ["*"]\ncors_allow_credentials = true\n')
    with pytest.raises(ValueError, match="cannot be combined with cors_allow_credentials"):
        load_config(path, environ={})
    with pytest.raises(ValueError, match="cannot be combined"):
        create_app(fixture_model(), cors_allow_origins=["*"], cors_allow_credentials=True)
    path.write_text('[server]\ncors_allow_origins = ["*"]\n')
    assert load_config(path, environ={}).server.cors_allow_origins == ("*",)
    path.write_text(
        '[server]\ncors_allow_origins = ["https://a.example"]\ncors_allow_credentials = true\n'
    )
    assert load_config(path, environ={}).server.cors_allow_credentials


@pytest.mark.parametrize(
    "origins",
    [["https://a.example/"], ["https://a.example/app"], ["a.example"], "https://a.example", [5]],
)
def test_cors_origins_must_be_origins(origins: object) -> None:
    with pytest.raises(ValueError, match="cors_allow_origins"):
        ServerConfig(cors_allow_origins=origins)  # type: ignore[arg-type]


def test_cors_flag_is_repeatable(tmp_path: Path) -> None:
    path = tmp_path / "neuronpy.toml"
    path.write_text('[server]\ncors_allow_origins = ["https://file.example"]\n')
    argv = ["serve", "--config", str(path)]
    args = build_parser().parse_args(
        [*argv, "--cors-allow-origin", ORIGIN, "--cors-allow-origin", "http://localhost:3000"]
    )
    assert config_from_args(args).server.cors_allow_origins == (ORIGIN, "http://localhost:3000")
    only_file = config_from_args(build_parser().parse_args(argv))
    assert only_file.server.cors_allow_origins == ("https://file.example",)
