"""API-key authentication and CORS, as ASGI middleware around the whole app."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Iterable

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from neuronpy.config import check_cors
from neuronpy.server.errors import ApiError

# Routes that answer without the key: a load balancer's probes carry no secret (readiness,
# liveness, and the load a router polls: counts of requests, nothing of theirs).
OPEN_PATHS = frozenset({"/health", "/live", "/get_load"})
# the web page's static files and icon (they hold no data: the page asks for the key to fetch any)
WEB_PATHS = frozenset({"/", "/batch", "/favicon.ico"})
WEB_PREFIX = "/static/"
# Headers a browser may send on a cross-origin request, and those its script may read.
CORS_METHODS = ("GET", "POST")
CORS_EXPOSE_HEADERS = ("Retry-After", "x-request-id")


def _digest(value: bytes) -> bytes:
    """Hashed first, so the constant-time comparison does not reveal the key's length."""
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    """Every HTTP request but those for OPEN_PATHS needs `Authorization: Bearer KEY` (or
    `x-api-key: KEY`); others get 401 with an OpenAI error body, whatever their path, so an
    unknown route reveals nothing. The decision is made on the ASGI scope's path alone (never
    the Host header or a full URL), and the key is compared in constant time. Neither the key
    nor what a client sent is ever logged or echoed."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        open_paths: Collection[str] = OPEN_PATHS,
        open_prefix: str | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._digest = _digest(api_key.encode())
        self._open_paths = frozenset(open_paths)
        self._open_prefix = open_prefix

    def _open(self, path: str) -> bool:
        prefix = self._open_prefix
        return path in self._open_paths or (prefix is not None and path.startswith(prefix))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._open(scope["path"]):
            await self.app(scope, receive, send)
            return
        sent = _presented_keys(scope.get("headers", ()))
        if sent is not None and self._matches(sent):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if sent is None:
            message = "no API key provided: send it as 'Authorization: Bearer KEY'"
        else:
            message = "invalid API key"
        challenge = {"WWW-Authenticate": "Bearer"}
        error = ApiError(401, message, code="invalid_api_key", headers=challenge)
        await error.response(scope["path"])(scope, receive, send)

    def _matches(self, presented: list[bytes]) -> bool:
        matched = False
        for key in presented:  # every one compared, so timing says nothing about which
            matched |= hmac.compare_digest(_digest(key), self._digest)
        return matched


def _presented_keys(headers: Iterable[tuple[bytes, bytes]]) -> list[bytes] | None:
    """The keys a request presents (bearer tokens and x-api-key values); None if it has
    neither header."""
    keys: list[bytes] | None = None
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip() if scheme.lower() == b"bearer" else b""
        elif name == b"x-api-key":
            token = value.strip()
        else:
            continue
        keys = [] if keys is None else keys
        if token:
            keys.append(token)
    return keys


def security_middleware(
    api_key: str | None,
    cors_allow_origins: Collection[str] = (),
    cors_allow_credentials: bool = False,
    web: bool = False,
) -> list[Middleware]:
    """The middleware stack, outermost first: CORS (only when origins are configured) around
    the API-key check, so a browser's preflight (OPTIONS, which carries no credentials) is
    answered without the key while the actual request still needs it; and a 401 still carries
    the CORS headers, so the page's script can read it."""
    origins = check_cors(tuple(cors_allow_origins), cors_allow_credentials)
    stack: list[Middleware] = []
    if origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=CORS_METHODS,
                allow_headers=("*",),  # OpenAI's clients add headers of their own
                allow_credentials=cors_allow_credentials,
                expose_headers=CORS_EXPOSE_HEADERS,
            )
        )
    if api_key:
        open_paths = OPEN_PATHS | WEB_PATHS if web else OPEN_PATHS
        prefix = WEB_PREFIX if web else None
        stack.append(
            Middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths, open_prefix=prefix)
        )
    return stack
