"""Image inputs of chat (spec §7.1): data: URLs, remote fetches and the private-address guard,
against real HTTP servers on loopback addresses."""

from __future__ import annotations

import base64
import io
import ipaddress
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from hypnos_site.errors import InvalidRequest
from inference.web.common.image_input import ImagePolicy, is_public, load_image

MIB = 1 << 20


def png(size: tuple[int, int] = (8, 8), color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


PNG = png()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` 8-bit grey pixels and holds one compressed row: its
    header is all a size check needs to read."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(bytes(width + 1)))
        + chunk(b"IEND", b"")
    )


TRICKLE_SECS = 40.0


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/trickle.png":
            self._trickle()
            return
        status, headers, body = self.routes.get(self.path, (404, {}, b"no such image"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self) -> None:
        """A valid PNG sent a few bytes at a time over TRICKLE_SECS: every read arrives in time,
        the whole body does not."""
        body = PNG + bytes(400)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        step = TRICKLE_SECS / len(body)
        try:
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(step)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as it should

    def log_message(self, *args: object) -> None:
        pass


def _serve(host: str, routes: dict[str, tuple[int, dict[str, str], bytes]]) -> Iterator[str]:
    handler = type("Handler", (_Handler,), {"routes": routes})
    server = ThreadingHTTPServer((host, 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def private_server() -> Iterator[str]:
    """An image server on 127.0.0.1: a private (loopback) host."""
    yield from _serve(
        "127.0.0.1",
        {
            "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
            "/big.png": (200, {"Content-Type": "image/png"}, png((600, 600)) + b"\0" * MIB),
            "/bomb.png": (200, {"Content-Type": "image/png"}, png_header_only(13000, 13000)),
            "/text": (200, {"Content-Type": "text/plain"}, b"not an image"),
        },
    )


@pytest.fixture
def stand_in_public_server(private_server: str) -> Iterator[tuple[str, str]]:
    """A server on 127.0.0.2 that the tests' policy treats as a public host; it redirects to
    the private one. Yields (its base URL, the private base URL)."""
    routes = {
        "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
        "/to-private": (302, {"Location": f"{private_server}/cat.png"}, b""),
        "/to-localhost": (302, {"Location": private_server.replace("127.0.0.1", "localhost") + "/cat.png"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
    }
    for base in _serve("127.0.0.2", routes):
        yield base, private_server


def policy(**overrides: object) -> ImagePolicy:
    values: dict[str, object] = {
        "max_bytes": 32 * MIB,
        "allow_remote": True,
        "allow_private": False,
        "max_pixels": 4096 * 4096,
        "fetch_timeout_secs": 10.0,
        **overrides,
    }
    return ImagePolicy(**values)  # type: ignore[arg-type]


def treating_127_0_0_2_as_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Test stand-in: the one loopback address the redirect tests play a public host on."""
    return address == ipaddress.ip_address("127.0.0.2") or is_public(address)


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "239.255.255.250",
        "255.255.255.255",
        "::1",
        "fe80::1",
        "fc00::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "ff02::1",
    ],
)
def test_it_counts_non_public_addresses_as_such(address):
    assert not is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888", "::ffff:8.8.8.8"])
def test_it_counts_public_addresses_as_public(address):
    assert is_public(ipaddress.ip_address(address))


# IPv6 spellings that reach an IPv4 address (or a non-global IPv6 range), each with what it
# reaches. The first six passed the check before (issue 12).
IPV6_NON_PUBLIC = [
    ("::127.0.0.1", "IPv4-compatible loopback"),
    ("64:ff9b::7f00:1", "NAT64 well-known prefix, loopback"),
    ("64:ff9b::a9fe:a9fe", "NAT64 well-known prefix, the metadata address 169.254.169.254"),
    ("2002:7f00:1::1", "6to4 of loopback"),
    ("::ffff:0:7f00:1", "IPv4-translated (SIIT) loopback"),
    ("fec0::1", "site-local"),
    ("::169.254.169.254", "IPv4-compatible metadata address"),
    ("::10.0.0.1", "IPv4-compatible private"),
    ("::ffff:169.254.169.254", "IPv4-mapped metadata address"),
    ("::ffff:0:a00:1", "IPv4-translated private"),
    ("64:ff9b::10.1.2.3", "NAT64 of a private address"),
    ("64:ff9b::c0a8:101", "NAT64 of 192.168.1.1"),
    ("64:ff9b:1::808:808", "NAT64 local-use prefix (RFC 8215), whatever it embeds"),
    ("64:ff9b:1:a9fe:a9:fe00::", "NAT64 local-use /48 spelling of the metadata address"),
    ("2002:a9fe:a9fe::1", "6to4 of the metadata address"),
    ("2002:a00:1::1", "6to4 of a private address"),
    ("2002::1", "6to4 of 0.0.0.0"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "Teredo (client 127.0.0.1)"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo (client 192.0.2.45)"),
    ("2001::1", "Teredo prefix"),
    ("fec0:1234::1", "site-local"),
    ("feff::1", "site-local, top of the range"),
    ("fd00::1", "unique-local"),
    ("fc00:abcd::1", "unique-local"),
    ("ff0e::1", "global-scope multicast"),
    ("ff05::2", "site-scope multicast"),
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("fe80::a:b", "link-local"),
    ("2001:db8::1", "documentation"),
    ("100::1", "discard-only"),
]


@pytest.mark.parametrize(("address", "reaches"), IPV6_NON_PUBLIC, ids=[a for a, _ in IPV6_NON_PUBLIC])
def test_it_refuses_every_ipv6_spelling_of_a_non_public_address(address, reaches):
    assert not is_public(ipaddress.ip_address(address)), reaches


@pytest.mark.parametrize(
    "address",
    ["64:ff9b::808:808", "::ffff:1.1.1.1", "2002:808:808::1", "2a00:1450:4001:80b::200e", "2606:4700:4700::1111"],
)
def test_it_counts_ipv6_spellings_of_public_addresses_as_public(address):
    assert is_public(ipaddress.ip_address(address))


async def test_it_refuses_an_image_declaring_more_pixels_than_max_image_pixels():
    bomb = png_header_only(13000, 13000)
    assert len(bomb) < 64 << 10
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as caught:
        await load_image(data_url(bomb), policy())
    assert time.perf_counter() - started < 0.5
    assert caught.value.param == "messages"
    # Pillow's own cap (twice the limit, set at start-up) stops it inside Image.open already.
    assert caught.value.message == "An image declares more pixels than limits.max_image_pixels allows (16777216)."
    with pytest.raises(InvalidRequest) as caught:
        await load_image(data_url(png_header_only(4097, 4096)), policy())
    assert caught.value.message == "An image is 4097x4096 pixels, above limits.max_image_pixels (16777216)."
    # At the cap it passes (the cap is on the product, not per side).
    assert await load_image(data_url(png((64, 32))), policy(max_pixels=64 * 32)) == png((64, 32))
    with pytest.raises(InvalidRequest, match="64x32 pixels"):
        await load_image(data_url(png((64, 32))), policy(max_pixels=64 * 32 - 1))


async def test_it_decodes_a_data_url():
    assert await load_image(data_url(PNG), policy()) == PNG


async def test_it_refuses_a_data_url_above_max_image_bytes():
    with pytest.raises(InvalidRequest) as caught:
        await load_image(data_url(PNG), policy(max_bytes=len(PNG) - 1))
    assert caught.value.status == 400 and "max_image_bytes" in caught.value.message


async def test_it_refuses_bad_base64_and_non_images():
    with pytest.raises(InvalidRequest, match="base64"):
        await load_image("data:image/png;base64,@@@@", policy())
    with pytest.raises(InvalidRequest, match="does not hold an image"):
        await load_image(data_url(b"hello, world", "text/plain"), policy())
    with pytest.raises(InvalidRequest, match="data: URL or an http"):
        await load_image("ftp://example.com/cat.png", policy())


async def test_it_refuses_remote_urls_when_they_are_off(private_server):
    with pytest.raises(InvalidRequest, match="allow_remote_image_urls"):
        await load_image(f"{private_server}/cat.png", policy(allow_remote=False, allow_private=True))


async def test_it_refuses_a_loopback_host_by_default(private_server):
    with pytest.raises(InvalidRequest) as caught:
        await load_image(f"{private_server}/cat.png", policy())
    assert "'127.0.0.1'" in caught.value.message and "allow_private_urls" in caught.value.message


async def test_it_refuses_localhost_by_name(private_server):
    with pytest.raises(InvalidRequest, match="'localhost' resolves to a non-public address"):
        await load_image(private_server.replace("127.0.0.1", "localhost") + "/cat.png", policy())


async def test_it_fetches_a_loopback_host_with_allow_private_urls(private_server):
    assert await load_image(f"{private_server}/cat.png", policy(allow_private=True)) == PNG


async def test_it_fetches_from_a_public_host(stand_in_public_server):
    public, _ = stand_in_public_server
    assert await load_image(f"{public}/cat.png", policy(public=treating_127_0_0_2_as_public)) == PNG


async def test_it_refuses_a_redirect_to_a_private_address(stand_in_public_server):
    public, _ = stand_in_public_server
    for path, host in (("/to-private", "'127.0.0.1'"), ("/to-localhost", "'localhost'")):
        with pytest.raises(InvalidRequest) as caught:
            await load_image(f"{public}{path}", policy(public=treating_127_0_0_2_as_public))
        assert host in caught.value.message


async def test_it_follows_a_redirect_to_a_private_address_with_allow_private_urls(stand_in_public_server):
    public, _ = stand_in_public_server
    assert await load_image(f"{public}/to-private", policy(allow_private=True)) == PNG


async def test_it_stops_a_redirect_loop(stand_in_public_server):
    public, _ = stand_in_public_server
    with pytest.raises(InvalidRequest, match="redirects more than"):
        await load_image(f"{public}/loop", policy(public=treating_127_0_0_2_as_public))


async def test_it_refuses_a_download_above_max_image_bytes_and_other_failures(private_server):
    with pytest.raises(InvalidRequest, match="max_image_bytes"):
        await load_image(f"{private_server}/big.png", policy(allow_private=True, max_bytes=MIB))
    with pytest.raises(InvalidRequest, match="HTTP 404"):
        await load_image(f"{private_server}/missing.png", policy(allow_private=True))
    with pytest.raises(InvalidRequest, match="does not hold an image"):
        await load_image(f"{private_server}/text", policy(allow_private=True))


async def test_it_ends_a_trickling_fetch_at_remote_fetch_timeout_secs(private_server):
    # Each byte comes well within httpx's read timeout; only the overall deadline ends it.
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as caught:
        await load_image(f"{private_server}/trickle.png", policy(allow_private=True, fetch_timeout_secs=1.0))
    elapsed = time.perf_counter() - started
    # The deadline ends it (1 s, set here), long before the trickle would (TRICKLE_SECS).
    assert 1.0 <= elapsed < 10, elapsed
    assert caught.value.param == "messages"
    assert caught.value.message == (
        f"Fetching the image URL '{private_server}/trickle.png' took longer than "
        "limits.remote_fetch_timeout_secs (1 s)."
    )


async def test_it_refuses_a_remote_image_declaring_more_pixels_than_max_image_pixels(private_server):
    with pytest.raises(InvalidRequest, match=r"more pixels than limits.max_image_pixels allows \(16777216\)"):
        await load_image(f"{private_server}/bomb.png", policy(allow_private=True))
