"""Images named by http(s) URLs, fetched for a request when the operator allows it
(`--image-urls`; off by default). A server that fetches what its clients name reaches what
they cannot, so every fetch is bounded:

- only http and https, and only to public addresses: the host is resolved first and every
  address it gives must be a global one (never loopback, private, link-local, shared,
  multicast or reserved), and the connection goes to the address that was checked (a second
  lookup cannot point it elsewhere; an https server still proves the host's name);
- no redirect is followed;
- the answer must be an image of a type read here (Content-Type), at most MAX_IMAGE_BYTES,
  in at most FETCH_SECONDS;
- a request's URLs are fetched one after another, MAX_IMAGES at most.

Each failure is the request's 400 naming the part."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import anyio
import httpx

from neuronpy.errors import InvalidRequestError
from neuronpy.server.chat_input import ChatInput
from neuronpy.server.images import MAX_IMAGE_BYTES, MIME_TYPES

FETCH_SECONDS = 10.0  # the whole of one fetch: resolving, connecting, the answer
USER_AGENT = "neuronpy-image-fetch"


def is_public_address(address: str) -> bool:
    """Whether an IP address is a global one (not loopback, private, link-local, shared,
    multicast, reserved or unspecified); an IPv4 address mapped into IPv6 as itself."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def fetch_remote_images(chat: ChatInput) -> None:
    """Fetches every http(s) image URL of `chat`'s messages (its decoding is left to
    ChatInput.images); InvalidRequestError naming the part of one that cannot be fetched."""
    for part, where in chat.image_parts():
        url = part.image_url.url if part.image_url is not None else ""
        if part._base64 is None and url[:8].lower().startswith(("http://", "https://")):
            part._fetched = await fetch_image(url, where)


async def fetch_image(url: str, where: str) -> bytes:
    """The bytes of the image at `url` (see the module's bounds)."""
    try:
        with anyio.fail_after(FETCH_SECONDS):
            return await _fetch(url, where)
    except TimeoutError:
        raise InvalidRequestError(
            f"'{where}': the image was not fetched within {FETCH_SECONDS:g} s", where
        ) from None
    except httpx.HTTPError as exc:
        raise InvalidRequestError(
            f"'{where}': the image could not be fetched ({type(exc).__name__})", where
        ) from None


async def _fetch(url: str, where: str) -> bytes:
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise InvalidRequestError(f"'{where}': an image URL must be http(s) with a host", where)
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    try:
        found = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise InvalidRequestError(f"'{where}': the image's host does not resolve", where) from None
    addresses = [str(info[4][0]) for info in found]
    if not addresses or not all(is_public_address(a) for a in addresses):
        raise InvalidRequestError(
            f"'{where}': the image's host is not a public address; this server fetches "
            "images from the internet only",
            where,
        )
    address = addresses[0]
    netloc = f"[{address}]" if ":" in address else address
    pinned = parts._replace(netloc=f"{netloc}:{port}").geturl()
    headers = {"Host": parts.netloc.rsplit("@", 1)[-1], "User-Agent": USER_AGENT}
    extensions = {"sni_hostname": host} if parts.scheme.lower() == "https" else {}
    async with (
        httpx.AsyncClient(follow_redirects=False, trust_env=False) as client,
        client.stream("GET", pinned, headers=headers, extensions=extensions) as response,
    ):
        if response.is_redirect:
            raise InvalidRequestError(
                f"'{where}': the image URL redirects; send the URL it redirects to", where
            )
        if response.status_code != 200:
            raise InvalidRequestError(
                f"'{where}': fetching the image answered HTTP {response.status_code}", where
            )
        kind = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind not in MIME_TYPES:
            raise InvalidRequestError(
                f"'{where}': the URL's content is {kind[:64] or 'untyped'!r}, not an image of "
                f"a type read here ({', '.join(sorted(MIME_TYPES))})",
                where,
            )
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
            raise _too_large(where)
        body = bytearray()
        async for piece in response.aiter_bytes():
            body += piece
            if len(body) > MAX_IMAGE_BYTES:
                raise _too_large(where)
    return bytes(body)


def _too_large(where: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"'{where}': the image is larger than {MAX_IMAGE_BYTES >> 20} MiB", where
    )
