"""The Files API (POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content):
OpenAI's File objects, a batch input checked line by line before it is kept, the size limits,
and the keys of spec §2 (a key sees only its own files). No model and no worker take part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.test import AsyncClient
from django.test.client import encode_multipart

from hypnos_site.config import KeyConfig
from logs.models import StoredFile
from tests.integration.conftest import with_server

pytestmark = pytest.mark.django_db(transaction=True)
ADMIN = "sk-admin-test"
BOUNDARY = "hypnos-test-boundary"
LINES = [
    {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "smollm2-135m"}}
    for i in range(3)
]
JSONL = "".join(json.dumps(line) + "\n" for line in LINES).encode()


@pytest.fixture(autouse=True)
def data_dir(settings: Any, tmp_path: Path) -> Path:
    with_server(
        settings,
        data_dir=str(tmp_path),
        api_keys=[ADMIN],
        keys=[KeyConfig(key="sk-a", label="team-a"), KeyConfig(key="sk-b", label="team-b")],
    )
    return tmp_path


@pytest.fixture
def api() -> AsyncClient:
    return AsyncClient()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def upload(
    api: AsyncClient, content: bytes = JSONL, key: str = "sk-a", purpose: str | None = "batch", name: str = "in.jsonl"
) -> Any:
    fields: dict[str, Any] = {"file": _Named(content, name)}
    if purpose is not None:
        fields["purpose"] = purpose
    return await api.post(
        "/v1/files",
        data=encode_multipart(BOUNDARY, fields),
        content_type=f"multipart/form-data; boundary={BOUNDARY}",
        headers=bearer(key),
    )


class _Named:
    """A file part for encode_multipart: its name and bytes."""

    def __init__(self, content: bytes, name: str):
        self.content, self.name = content, name

    def read(self) -> bytes:
        return self.content


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def stored(data_dir: Path) -> list[str]:
    """Every file under data_dir/files, temporary ones included."""
    root = data_dir / "files"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


async def test_an_upload_is_kept_listed_read_back_and_deleted(api, data_dir):
    response = await upload(api)
    assert response.status_code == 200, response.content
    created = response.json()
    assert created["id"].startswith("file-") and created["object"] == "file"
    assert created | {"id": "", "created_at": 0} == {
        "id": "",
        "object": "file",
        "bytes": len(JSONL),
        "created_at": 0,
        "expires_at": None,
        "filename": "in.jsonl",
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
    }
    assert stored(data_dir) == [created["id"]]

    listing = (await api.get("/v1/files", headers=bearer("sk-a"))).json()
    assert listing["object"] == "list" and [f["id"] for f in listing["data"]] == [created["id"]]
    assert listing["has_more"] is False
    assert (await api.get(f"/v1/files/{created['id']}", headers=bearer("sk-a"))).json() == created

    content = await api.get(f"/v1/files/{created['id']}/content", headers=bearer("sk-a"))
    assert content.status_code == 200
    assert b"".join([chunk async for chunk in content.streaming_content]) == JSONL

    deleted = await api.delete(f"/v1/files/{created['id']}", headers=bearer("sk-a"))
    assert deleted.json() == {"id": created["id"], "object": "file", "deleted": True}
    error_of(await api.get(f"/v1/files/{created['id']}", headers=bearer("sk-a")), 404)
    assert stored(data_dir) == [] and not await StoredFile.objects.aexists()


async def test_a_key_sees_reads_and_deletes_only_its_own_files(api):
    mine = (await upload(api, key="sk-a")).json()["id"]
    theirs = (await upload(api, key="sk-b")).json()["id"]
    assert [f["id"] for f in (await api.get("/v1/files", headers=bearer("sk-a"))).json()["data"]] == [mine]
    for method, path in [
        ("get", f"/v1/files/{theirs}"),
        ("get", f"/v1/files/{theirs}/content"),
        ("delete", f"/v1/files/{theirs}"),
    ]:
        error = error_of(await getattr(api, method)(path, headers=bearer("sk-a")), 404)
        assert error["type"] == "not_found" and theirs in error["message"]
    # An admin key sees every key's files, and the other key's file is still there.
    everyone = (await api.get("/v1/files", headers=bearer(ADMIN))).json()["data"]
    assert {f["id"] for f in everyone} == {mine, theirs}


async def test_a_listing_pages_with_limit_and_after(api):
    ids = [(await upload(api)).json()["id"] for _ in range(3)]
    first = (await api.get("/v1/files?order=asc&limit=2", headers=bearer("sk-a"))).json()
    assert [f["id"] for f in first["data"]] == ids[:2] and first["has_more"] is True
    rest = (await api.get(f"/v1/files?order=asc&limit=2&after={first['last_id']}", headers=bearer("sk-a"))).json()
    assert [f["id"] for f in rest["data"]] == ids[2:] and rest["has_more"] is False
    newest = (await api.get("/v1/files?limit=1", headers=bearer("sk-a"))).json()
    assert [f["id"] for f in newest["data"]] == ids[-1:]
    assert error_of(await api.get("/v1/files?limit=0", headers=bearer("sk-a")), 400)["param"] == "limit"
    assert error_of(await api.get("/v1/files?order=up", headers=bearer("sk-a")), 400)["param"] == "order"


@pytest.mark.parametrize(
    ("content", "purpose", "param", "words"),
    [
        (JSONL, None, "purpose", "purpose is required"),
        (JSONL, "fine-tune", "purpose", "not 'fine-tune'"),
        (JSONL[:-1] + b"\nnot json\n", "batch", "file", "Line 4"),
        (
            b'{"custom_id": "a"}\n[1, 2]\n',
            "batch",
            "file",
            "Line 2 of the batch file is refused: it is not a JSON",
        ),
        (b"\n\n", "batch", "file", "holds no request"),
        (b"[" * 200_000 + b"\n", "batch", "file", "Line 1"),
    ],
)
async def test_a_refused_upload_leaves_nothing_behind(api, data_dir, content, purpose, param, words):
    error = error_of(await upload(api, content, purpose=purpose), 400)
    assert error["param"] == param and words in error["message"], error
    assert stored(data_dir) == [] and not await StoredFile.objects.aexists()


async def test_the_size_limits_refuse_before_anything_is_kept(api, settings, data_dir):
    with_server(settings, files_max_bytes=len(JSONL) - 1)
    error = error_of(await upload(api), 400)
    assert "server.files_max_bytes" in error["message"] and error["param"] == "file"
    with_server(settings, files_max_bytes=1 << 20, files_max_bytes_per_key=len(JSONL) * 2)
    assert (await upload(api)).status_code == 200
    assert (await upload(api)).status_code == 200
    error = error_of(await upload(api), 400)
    assert "server.files_max_bytes_per_key" in error["message"]
    # Another key has room of its own.
    assert (await upload(api, key="sk-b")).status_code == 200
    assert len(stored(data_dir)) == 3


async def test_a_file_id_that_is_not_one_is_a_404_not_a_path(api):
    for file_id in ["..", "file-../../etc", "file-" + "0" * 32, "FILE-" + "a" * 32]:
        error_of(await api.get(f"/v1/files/{file_id}", headers=bearer(ADMIN)), 404)
    error_of(await api.get("/v1/files/%2e%2e/content", headers=bearer(ADMIN)), 404)


async def test_an_upload_without_a_file_part_is_a_400(api):
    response = await api.post(
        "/v1/files",
        data=encode_multipart(BOUNDARY, {"purpose": "batch"}),
        content_type=f"multipart/form-data; boundary={BOUNDARY}",
        headers=bearer("sk-a"),
    )
    assert error_of(response, 400)["param"] == "file"
