"""Image parts of chat messages (spec §7.1): `data:` URLs decoded, http(s) URLs fetched when
limits.allow_remote_image_urls allows, each image at most limits.max_image_bytes and, by its
header, at most limits.max_image_pixels.

A remote fetch refuses hosts that resolve to loopback, private, link-local, multicast or other
non-public addresses (IPv4 embedded in IPv6 judged as itself) unless limits.allow_private_urls is
on, on every redirect hop, and connects to the address it checked (so a second DNS answer cannot
point it elsewhere). The whole fetch, redirects included, ends within
limits.remote_fetch_timeout_secs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from hypnos_site.config import LimitsConfig
from hypnos_site.errors import InvalidRequest

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_REDIRECTS = 5
USER_AGENT = "hypnos-image-fetch"
# IPv6 prefixes whose last 32 bits are an IPv4 address a gateway or the host's own stack
# reaches: IPv4-compatible (::a.b.c.d, RFC 4291), SIIT's IPv4-translated (::ffff:0:a.b.c.d,
# RFC 2765) and NAT64's well-known prefix (64:ff9b::/96, RFC 6052). IPv4-mapped and 6to4 have
# their own accessors in `ipaddress`.
_TRAILING_IPV4_PREFIXES = (bytes(12), bytes(8) + b"\xff\xff\0\0", b"\0\x64\xff\x9b" + bytes(8))
# NAT64 local-use prefixes (RFC 8215): where the IPv4 address sits depends on the operator's
# prefix length, so the whole range is refused.
_NAT64_LOCAL_USE = ipaddress.IPv6Network("64:ff9b:1::/48")


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, translated, NAT64, 6to4,
    Teredo's client), or None."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address.packed[:12] in _TRAILING_IPV4_PREFIXES:
        return ipaddress.IPv4Address(address.packed[12:])
    return None


def is_public(address: IpAddress) -> bool:
    """A globally routable unicast address. An IPv6 address that embeds an IPv4 address is
    judged by that IPv4 address too (a NAT64 gateway, a 6to4 relay or the host's own stack
    would connect to it)."""
    if isinstance(address, ipaddress.IPv4Address):
        return address.is_global and not address.is_multicast
    if address in _NAT64_LOCAL_USE:
        return False
    embedded = embedded_ipv4(address)
    if embedded is not None and not is_public(embedded):
        return False
    if address.ipv4_mapped is not None or address.packed[:12] in _TRAILING_IPV4_PREFIXES:
        # Prefixes `ipaddress` counts as reserved or private: the IPv4 address alone decides.
        return True
    return address.is_global and not (address.is_multicast or address.is_site_local or address.is_reserved)


@dataclass(frozen=True)
class ImagePolicy:
    """The [limits] that govern image inputs; `public` decides which addresses count as public
    (tests stand a loopback address in for a public host through it)."""

    max_bytes: int
    allow_remote: bool
    allow_private: bool
    max_pixels: int
    fetch_timeout_secs: float
    public: Callable[[IpAddress], bool] = is_public
    # What a remote fetch is for: the request field its errors name, the word for it, the limit
    # its size is held to and the error above it (documents fetch through the same rules).
    param: str = "messages"
    noun: str = "image"
    limit_name: str = "limits.max_image_bytes"
    accept: str = "image/*"
    too_large: Callable[[str], InvalidRequest] = lambda message: InvalidRequest(message, param="messages")

    @classmethod
    def from_limits(cls, limits: LimitsConfig) -> ImagePolicy:
        return cls(
            max_bytes=limits.max_image_bytes,
            allow_remote=limits.allow_remote_image_urls,
            allow_private=limits.allow_private_urls,
            max_pixels=limits.max_image_pixels,
            fetch_timeout_secs=limits.remote_fetch_timeout_secs,
        )


async def load_image(url: str, policy: ImagePolicy) -> bytes:
    """The bytes of one image_url.url, checked to be an image (400 otherwise)."""
    if url.startswith("data:"):
        data = decode_data_url(url, policy.max_bytes)
    elif urlsplit(url).scheme.lower() in ("http", "https"):
        if not policy.allow_remote:
            raise InvalidRequest(
                "Remote image URLs are turned off on this server (limits.allow_remote_image_urls); "
                "send the image as a data: URL.",
                param="messages",
            )
        data = await fetch(url, policy)
    else:
        raise InvalidRequest("image_url.url must be a data: URL or an http(s) URL.", param="messages")
    check_image(data, policy.max_pixels)
    return data


def decode_data_url(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise InvalidRequest("The image's data: URL has no ',' before its data.", param="messages")
    is_base64 = header.lower().endswith(";base64")
    # Refused before decoding: base64 grows the bytes by a third.
    if (len(payload) * 3 // 4 if is_base64 else len(payload)) > max_bytes + 3:
        raise _image_too_large(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True) if is_base64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError):
        raise InvalidRequest("The image's data: URL does not hold valid base64.", param="messages") from None
    if len(data) > max_bytes:
        raise _image_too_large(max_bytes)
    return data


def check_image(data: bytes, max_pixels: int, param: str = "messages") -> str | None:
    """400 unless Pillow recognises the bytes as an image of at most `max_pixels` (the worker
    decodes them fully: a few KB of PNG can declare gigabytes of pixels). `Image.open` reads
    only the header, so the size is known before anything is decompressed. Returns Pillow's
    name of the format (PNG, JPEG, WEBP...); errors name `param`."""
    try:
        with warnings.catch_warnings():
            # Pillow warns between MAX_IMAGE_PIXELS and twice that; the check below refuses it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise InvalidRequest(
                        f"An image is {width}x{height} pixels, above limits.max_image_pixels ({max_pixels}).",
                        param=param,
                    )
                found = image.format
                image.verify()
                return found
    except Image.DecompressionBombError:
        # Pillow's own cap (twice Image.MAX_IMAGE_PIXELS, set from the limit) refused it in open().
        raise InvalidRequest(
            f"An image declares more pixels than limits.max_image_pixels allows ({max_pixels}).", param=param
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        what = "The image_url does not hold" if param == "messages" else f"{param} is not"
        raise InvalidRequest(
            f"{what} an image Hypnos can decode (PNG, JPEG, WebP, GIF, ...): {exc}", param=param
        ) from None


async def fetch(url: str, policy: ImagePolicy) -> bytes:
    """GET the URL, following redirects by hand so that every hop's host is checked, all of it
    (resolution, redirects, a body that trickles in) within policy.fetch_timeout_secs."""
    try:
        async with asyncio.timeout(policy.fetch_timeout_secs):
            return await _fetch(url, policy)
    except ValueError as exc:
        # urlsplit's refusal of a malformed netloc ("http://[::1/", a port of 99999 or "x") and
        # the IDNA codec's of a host label over 63 characters (a UnicodeError): no URL at all.
        raise InvalidRequest(f"The {policy.noun} URL {url!r} is malformed: {exc}", param=policy.param) from None
    except TimeoutError:
        raise InvalidRequest(
            f"Fetching the {policy.noun} URL {url!r} took longer than limits.remote_fetch_timeout_secs "
            f"({policy.fetch_timeout_secs:g} s).",
            param=policy.param,
        ) from None


async def _fetch(url: str, policy: ImagePolicy) -> bytes:
    # httpx's timeout is per connect or read; the overall deadline is fetch()'s.
    timeout = httpx.Timeout(policy.fetch_timeout_secs)
    # trust_env off: a proxy would connect on our behalf, to hosts we never checked.
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
        for _hop in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
                raise InvalidRequest(
                    f"The {policy.noun} URL {url!r} is not an http(s) URL with a host.", param=policy.param
                )
            address = await _checked_address(parts.hostname, parts.port, policy)
            location = await _get(client, url, address, policy)
            if isinstance(location, bytes):
                return location
            url = urljoin(url, location)
    raise InvalidRequest(f"The {policy.noun} URL redirects more than {MAX_REDIRECTS} times.", param=policy.param)


async def _checked_address(host: str, port: int | None, policy: ImagePolicy) -> IpAddress:
    """The address to connect to: every address the host resolves to must be public, unless
    private URLs are allowed."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InvalidRequest(
            f"The {policy.noun} host {host!r} cannot be resolved: {exc.strerror}", param=policy.param
        ) from None
    # An IPv6 link-local answer carries its zone ("fe80::1%eth0"): the address is what precedes it.
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not policy.allow_private:
        refused = [a for a in addresses if not policy.public(a)]
        if refused:
            raise InvalidRequest(
                f"The {policy.noun} host {host!r} resolves to a non-public address ({refused[0]}); "
                "such fetches are refused (limits.allow_private_urls).",
                param=policy.param,
            )
    return addresses[0]


async def _get(client: httpx.AsyncClient, url: str, address: IpAddress, policy: ImagePolicy) -> bytes | str:
    """The body, or the Location of a redirect. Connects to `address`, with the URL's host as
    Host header and TLS server name."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    literal = f"[{address}]" if address.version == 6 else str(address)
    netloc = literal + (f":{parts.port}" if parts.port else "")
    pinned = parts._replace(netloc=netloc).geturl()
    headers = {"Host": parts.netloc.rpartition("@")[2], "User-Agent": USER_AGENT, "Accept": policy.accept}
    try:
        async with client.stream("GET", pinned, headers=headers, extensions={"sni_hostname": host}) as response:
            if response.is_redirect:
                location = response.headers.get("location")
                if not location:
                    raise InvalidRequest(
                        f"The {policy.noun} URL {url!r} redirects without a Location.", param=policy.param
                    )
                return location
            if response.status_code != 200:
                raise InvalidRequest(
                    f"Fetching the {policy.noun} URL {url!r} answered HTTP {response.status_code}.", param=policy.param
                )
            declared = response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                raise _too_large(policy)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > policy.max_bytes:
                    raise _too_large(policy)
            return bytes(body)
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"Fetching the {policy.noun} URL {url!r} failed: {exc}", param=policy.param) from None


def _image_too_large(max_bytes: int) -> InvalidRequest:
    return InvalidRequest(f"An image is larger than limits.max_image_bytes ({max_bytes} bytes).", param="messages")


def _too_large(policy: ImagePolicy) -> InvalidRequest:
    return policy.too_large(f"The {policy.noun} is larger than {policy.limit_name} ({policy.max_bytes} bytes).")
