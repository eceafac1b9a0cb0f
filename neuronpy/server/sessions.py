"""Sessions over HTTP: a request's session checked against its model; list, show, delete."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.sessions import SessionStore, check_compatible
from neuronpy.engine.types import SessionRequest
from neuronpy.errors import InvalidRequestError
from neuronpy.server.errors import ApiError, api_error
from neuronpy.server.protocol import SamplingRequest
from neuronpy.server.response_ids import RESPONSE_ID

SESSIONS_OFF = (
    "sessions are off on this server; start it with --sessions-dir DIR ([server] sessions_dir)"
)
T = TypeVar("T")


async def _in_thread(call: Callable[..., T], *args: Any) -> T:
    """A store call (it reads and writes files), its refusals (a bad name, a bad file) 400s."""
    try:
        return await anyio.to_thread.run_sync(call, *args)
    except InvalidRequestError as exc:
        raise api_error(exc) from None


async def session_request(
    store: SessionStore | None, engine: ServingEngine, req: SamplingRequest
) -> SessionRequest | None:
    """What the request asks of its session, its file's header checked against the model:
    400 when sessions are off, for a bad name, for a file that is not a session neuronpy can
    read, and for a session of another model, dtype or KV shape, or longer than the context."""
    if req.session_name is None:
        return None
    if store is None:
        raise ApiError(400, SESSIONS_OFF, param="session")
    return await open_session(store, engine, req.session_name, req.session_save)


async def open_session(
    store: SessionStore,
    engine: ServingEngine,
    name: str,
    save: bool,
    save_as: str | None = None,
) -> SessionRequest:
    """Session `name` checked against the model (see session_request); `save_as`: save into
    that session instead."""
    info = await _in_thread(store.info, name)
    try:
        if info is not None:
            facts = engine.facts
            check_compatible(
                info,
                engine.name,
                engine.fingerprint,
                facts.dtype,
                layout=(facts.num_kv_layers, facts.num_kv_heads, facts.head_dim),
                context_len=engine.context_len,
            )
        path = store.path(name)
        save_path = store.path(save_as) if save_as is not None else None
    except InvalidRequestError as exc:
        raise api_error(exc) from None
    tokens = info.token_ids if info is not None else None
    return SessionRequest(name, path, save, tokens, save_path)


async def list_sessions(store: SessionStore) -> dict[str, Any]:
    """Every session in the directory that a client named; one that cannot be read is listed
    with why (so that it can be found and deleted), not a failure of the whole list. The KV of
    stored responses (sessions named by a response's id, `resp_<hex>`) is not listed: an id is
    what lets its holder read the response, and the listing must not hand it to every key
    holder. (Whoever holds one may still show or delete its session by name.)"""
    data = []
    names = await _in_thread(store.names)
    for name in (n for n in names if not RESPONSE_ID.fullmatch(n)):
        try:
            info = await anyio.to_thread.run_sync(store.info, name)
        except InvalidRequestError as exc:
            data.append({"id": name, "object": "session", "error": exc.message})
            continue
        if info is not None:  # (deleted meanwhile)
            data.append(info.public())
    return {"object": "list", "data": data}


async def show_session(store: SessionStore, name: str) -> dict[str, Any]:
    info = await _in_thread(store.info, name)
    if info is None:
        raise ApiError(404, f"no session {name!r}", param="session")
    return info.public()


async def delete_session(store: SessionStore, name: str) -> dict[str, Any]:
    if not await _in_thread(store.delete, name):
        raise ApiError(404, f"no session {name!r}", param="session")
    return {"id": name, "object": "session.deleted", "deleted": True}
