"""Image parts of chat messages (spec §7.1): `data:` URLs decoded, http(s) URLs fetched when
limits.allow_remote_image_urls allows, each image at most limits.max_image_bytes.

A remote fetch refuses hosts that resolve to loopback, private, link-local, multicast or other
non-public addresses unless limits.allow_private_urls is on, on every redirect hop, and
connects to the address it checked (so a second DNS answer cannot point it elsewhere).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from hypnos_site.config import LimitsConfig
from inference.errors import InvalidRequest

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_REDIRECTS = 5
FETCH_TIMEOUT_SECS = 30.0
USER_AGENT = "hypnos-image-fetch"


def is_public(address: IpAddress) -> bool:
    """A globally routable unicast address (IPv4-mapped IPv6 judged as its IPv4 address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


@dataclass(frozen=True)
class ImagePolicy:
    """The [limits] that govern image inputs; `public` decides which addresses count as public
    (tests stand a loopback address in for a public host through it)."""

    max_bytes: int
    allow_remote: bool
    allow_private: bool
    public: Callable[[IpAddress], bool] = is_public

    @classmethod
    def from_limits(cls, limits: LimitsConfig) -> ImagePolicy:
        return cls(max_bytes=limits.max_image_bytes, allow_remote=limits.allow_remote_image_urls,
                   allow_private=limits.allow_private_urls)


async def load_image(url: str, policy: ImagePolicy) -> bytes:
    """The bytes of one image_url.url, checked to be an image (400 otherwise)."""
    if url.startswith("data:"):
        data = decode_data_url(url, policy.max_bytes)
    elif urlsplit(url).scheme.lower() in ("http", "https"):
        if not policy.allow_remote:
            raise InvalidRequest("Remote image URLs are turned off on this server (limits.allow_remote_image_urls); "
                                 "send the image as a data: URL.", param="messages")
        data = await fetch(url, policy)
    else:
        raise InvalidRequest("image_url.url must be a data: URL or an http(s) URL.", param="messages")
    check_image(data)
    return data


def decode_data_url(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise InvalidRequest("The image's data: URL has no ',' before its data.", param="messages")
    is_base64 = header.lower().endswith(";base64")
    # Refused before decoding: base64 grows the bytes by a third.
    if (len(payload) * 3 // 4 if is_base64 else len(payload)) > max_bytes + 3:
        raise _too_large(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True) if is_base64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError):
        raise InvalidRequest("The image's data: URL does not hold valid base64.", param="messages") from None
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def check_image(data: bytes) -> None:
    """400 unless Pillow recognises the bytes as an image (the engine decodes them fully)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"The image_url does not hold an image Hypnos can decode (PNG, JPEG, WebP, GIF, ...): "
                             f"{exc}", param="messages") from None


async def fetch(url: str, policy: ImagePolicy) -> bytes:
    """GET the URL, following redirects by hand so that every hop's host is checked."""
    timeout = httpx.Timeout(FETCH_TIMEOUT_SECS)
    # trust_env off: a proxy would connect on our behalf, to hosts we never checked.
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
        for _hop in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
                raise InvalidRequest(f"The image URL {url!r} is not an http(s) URL with a host.", param="messages")
            address = await _checked_address(parts.hostname, parts.port, policy)
            location = await _get(client, url, address, policy.max_bytes)
            if isinstance(location, bytes):
                return location
            url = urljoin(url, location)
    raise InvalidRequest(f"The image URL redirects more than {MAX_REDIRECTS} times.", param="messages")


async def _checked_address(host: str, port: int | None, policy: ImagePolicy) -> IpAddress:
    """The address to connect to: every address the host resolves to must be public, unless
    private URLs are allowed."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InvalidRequest(f"The image host {host!r} cannot be resolved: {exc.strerror}", param="messages") from None
    # An IPv6 link-local answer carries its zone ("fe80::1%eth0"): the address is what precedes it.
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not policy.allow_private:
        refused = [a for a in addresses if not policy.public(a)]
        if refused:
            raise InvalidRequest(
                f"The image host {host!r} resolves to a non-public address ({refused[0]}); such fetches are refused "
                "(limits.allow_private_urls).", param="messages")
    return addresses[0]


async def _get(client: httpx.AsyncClient, url: str, address: IpAddress, max_bytes: int) -> bytes | str:
    """The body, or the Location of a redirect. Connects to `address`, with the URL's host as
    Host header and TLS server name."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    literal = f"[{address}]" if address.version == 6 else str(address)
    netloc = literal + (f":{parts.port}" if parts.port else "")
    pinned = parts._replace(netloc=netloc).geturl()
    headers = {"Host": parts.netloc.rpartition("@")[2], "User-Agent": USER_AGENT, "Accept": "image/*"}
    try:
        async with client.stream("GET", pinned, headers=headers, extensions={"sni_hostname": host}) as response:
            if response.is_redirect:
                location = response.headers.get("location")
                if not location:
                    raise InvalidRequest(f"The image URL {url!r} redirects without a Location.", param="messages")
                return location
            if response.status_code != 200:
                raise InvalidRequest(f"Fetching the image URL {url!r} answered HTTP {response.status_code}.",
                                     param="messages")
            declared = response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise _too_large(max_bytes)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise _too_large(max_bytes)
            return bytes(body)
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"Fetching the image URL {url!r} failed: {exc}", param="messages") from None


def _too_large(max_bytes: int) -> InvalidRequest:
    return InvalidRequest(f"An image is larger than limits.max_image_bytes ({max_bytes} bytes).", param="messages")
