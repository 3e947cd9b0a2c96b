"""The picture store of document conversions (spec §12) and its routes: stored through the
store's own API (what a conversion with return_pictures calls), read and deleted through the
views, with the keys of spec §2. No model and no inference worker take part."""

from __future__ import annotations

import base64
import io
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.test import AsyncClient
from django.urls import resolve
from django.utils import timezone
from PIL import Image

from hypnos_site.config import KeyConfig
from inference.transport.runtime import runtime
from inference.worker import Worker
from logs import pictures, views
from logs.models import StoredDocument, StoredPicture
from tests.integration.conftest import with_server

pytestmark = pytest.mark.django_db(transaction=True)
ADMIN = "sk-admin-test"
BBOX = {"l": 72.0, "t": 540.2, "r": 380.5, "b": 318.9, "coord_origin": "BOTTOMLEFT"}
PAGE_SIZE = {"width": 612.0, "height": 792.0}


def png(width: int = 64, height: int = 40, colour: str = "teal") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(autouse=True)
def data_dir(settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data_dir of the test's own, and a store that expires lazily only when a test says so."""
    with_server(settings, data_dir=str(tmp_path))
    monkeypatch.setattr(pictures, "_expiry", pictures._Throttle(3600))
    return tmp_path


@pytest.fixture
def api() -> AsyncClient:
    return AsyncClient()


def with_keys(settings: Any) -> None:
    with_server(
        settings,
        api_keys=[ADMIN],
        keys=[KeyConfig(key="sk-a", label="team-a"), KeyConfig(key="sk-b", label="team-b")],
    )


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def keep(*images: bytes, owner: str | None = None, filename: str = "report.pdf") -> str:
    """A document as a conversion stores it: picture i+1 on page i+1, the first with a caption."""
    document_id = pictures.new_document_id()
    pictures.create_document(document_id, owner=owner, filename=filename, model="docling")
    for number, image in enumerate(images, start=1):
        pictures.add_picture(
            document_id,
            index=number,
            page=number,
            png=image,
            width=64,
            height=40,
            dpi=144,
            bbox=BBOX,
            page_size=PAGE_SIZE,
            caption="Figure 1: revenue by quarter" if number == 1 else None,
            ref=f"#/pictures/{number - 1}" if number == 1 else None,
        )
    return document_id


akeep = sync_to_async(keep)


def not_found(response: Any) -> str:
    assert response.status_code == 404, response.content
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "not_found"
    return body["error"]["message"]


def folder(data_dir: Path, document_id: str) -> Path:
    return data_dir / "pictures" / document_id


# -- the three reads and the delete -----------------------------------------------------------------


async def test_it_lists_a_documents_pictures_without_their_images(api):
    document_id = await akeep(png(), png(colour="navy"))
    response = await api.get(f"/v1/documents/{document_id}/pictures")
    assert response.status_code == 200
    body = response.json()
    document = await StoredDocument.objects.aget(id=document_id)
    assert body["object"] == "list" and body["document_id"] == document_id
    assert body["expires_at"] == document.expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    first, second = body["data"]
    assert first == {
        "object": "document.picture",
        "document_id": document_id,
        "index": 1,
        "page": 1,
        "url": f"/v1/documents/{document_id}/pictures/1",
        "mime": "image/png",
        "bytes": len(png()),
        "width": 64,
        "height": 40,
        "dpi": 144,
        "bbox": BBOX,
        "page_size": PAGE_SIZE,
        "caption": "Figure 1: revenue by quarter",
        "ref": "#/pictures/0",
    }
    # caption and ref only when docling found them.
    assert second["index"] == 2 and "caption" not in second and "ref" not in second and "image" not in second


async def test_it_returns_one_picture_with_its_image_in_base64(api):
    document_id = await akeep(png(), png(colour="navy"))
    response = await api.get(f"/v1/documents/{document_id}/pictures/2")
    assert response.status_code == 200
    record = response.json()
    assert record["index"] == 2 and record["object"] == "document.picture"
    assert base64.b64decode(record["image"]) == png(colour="navy")


async def test_format_image_returns_the_bare_png_not_to_be_cached(api):
    document_id = await akeep(png(), png(colour="navy"))
    response = await api.get(f"/v1/documents/{document_id}/pictures/1?format=image")
    assert response.status_code == 200
    assert response.content == png()
    assert response["Content-Type"] == "image/png"
    assert response["Cache-Control"] == "private, no-store"
    assert Image.open(io.BytesIO(response.content)).size == (64, 40)


async def test_delete_releases_the_records_and_the_files(api, data_dir):
    document_id = await akeep(png(), png())
    assert len(list(folder(data_dir, document_id).iterdir())) == 2
    response = await api.delete(f"/v1/documents/{document_id}")
    assert response.status_code == 200
    assert response.json() == {"object": "document.deleted", "id": document_id, "deleted": True}
    assert not folder(data_dir, document_id).exists()
    assert not await StoredPicture.objects.filter(document_id=document_id).aexists()
    not_found(await api.get(f"/v1/documents/{document_id}/pictures"))
    not_found(await api.delete(f"/v1/documents/{document_id}"))


async def test_unknown_documents_and_indexes_are_not_found(api):
    document_id = await akeep(png(), png())
    assert "no picture 3; it has 2" in not_found(await api.get(f"/v1/documents/{document_id}/pictures/3"))
    not_found(await api.get(f"/v1/documents/{document_id}/pictures/0"))
    not_found(await api.get(f"/v1/documents/{document_id}/pictures/0?format=image"))
    unknown = pictures.new_document_id()
    for path in (f"/v1/documents/{unknown}/pictures", f"/v1/documents/{unknown}/pictures/1"):
        assert "No document has the id" in not_found(await api.get(path))
    not_found(await api.delete(f"/v1/documents/{unknown}"))


async def test_path_traversal_attempts_are_not_found(api, data_dir):
    document_id = await akeep(png())
    (data_dir / "secret.txt").write_text("not a picture")
    for path in (
        "/v1/documents/../secret.txt/pictures",
        "/v1/documents/..%2fsecret.txt/pictures/1",
        f"/v1/documents/{document_id}/..%2f..%2fsecret.txt/pictures/1",
        f"/v1/documents/{document_id}/pictures/..%2f..%2f..%2fsecret.txt",
        f"/v1/documents/{document_id}/pictures/1%2f..",
        f"/v1/documents/{document_id}/pictures/-1",
        f"/v1/documents/{document_id.upper()}/pictures/1",
        f"/v1/documents/{document_id}0/pictures/1",
        f"/v1/documents/{document_id[:-1]}/pictures/1",
    ):
        response = await api.get(path)
        assert b"not a picture" not in response.content, path
        not_found(response)
    not_found(await api.delete("/v1/documents/..%2fsecret.txt"))
    assert (data_dir / "secret.txt").exists()
    # The store itself refuses to make a path from anything but an id.
    for bad in ("../secret.txt", "doc-" + "0" * 31 + "/", document_id + "/.."):
        with pytest.raises(ValueError, match="not a picture store document id"):
            await sync_to_async(pictures.discard_document)(bad)


def test_the_convert_route_is_not_captured_by_the_document_routes():
    for path in ("/v1/documents/convert", "/api/v1/documents/convert"):
        view = resolve(path).func.view_class  # type: ignore[attr-defined]
        assert view not in (views.DocumentView, views.DocumentPicturesView, views.DocumentPictureView), path


# -- who sees a document ----------------------------------------------------------------------------


async def test_another_key_sees_none_of_the_documents_of_a_key(api, settings, data_dir):
    with_keys(settings)
    document_id = await akeep(png(), owner="team-a")
    picture = f"/v1/documents/{document_id}/pictures/1"
    for path in (f"/v1/documents/{document_id}/pictures", picture, picture + "?format=image"):
        assert (await api.get(path, headers=bearer("sk-a"))).status_code == 200, path
        # The same answer as for an id that does not exist: the id is not confirmed.
        assert "No document has the id" in not_found(await api.get(path, headers=bearer("sk-b"))), path
    not_found(await api.delete(f"/v1/documents/{document_id}", headers=bearer("sk-b")))
    assert folder(data_dir, document_id).exists()
    assert (await api.get(picture)).status_code == 401
    assert (await api.delete(f"/v1/documents/{document_id}", headers=bearer("sk-a"))).status_code == 200


async def test_an_admin_key_sees_every_document(api, settings):
    with_keys(settings)
    mine = await akeep(png(), owner="team-a")
    from_the_open_api = await akeep(png())
    for document_id in (mine, from_the_open_api):
        response = await api.get(f"/v1/documents/{document_id}/pictures/1", headers=bearer(ADMIN))
        assert response.status_code == 200 and response.json()["document_id"] == document_id
    # A document stored before keys were configured belongs to no key but the admins'.
    not_found(await api.get(f"/v1/documents/{from_the_open_api}/pictures", headers=bearer("sk-a")))
    assert (await api.delete(f"/v1/documents/{mine}", headers=bearer(ADMIN))).status_code == 200


async def test_with_no_key_configured_everyone_reads(api):
    document_id = await akeep(png(), owner="team-a")
    assert (await api.get(f"/v1/documents/{document_id}/pictures")).status_code == 200
    response = await api.get(f"/v1/documents/{document_id}/pictures/1", headers=bearer("anything"))
    assert response.status_code == 200


# -- expiry -----------------------------------------------------------------------------------------


def expire_now(document_id: str) -> None:
    StoredDocument.objects.filter(id=document_id).update(expires_at=timezone.now() - timedelta(seconds=1))


async def test_an_expired_document_is_not_found_and_expire_deletes_it(api, data_dir):
    expired, kept = await akeep(png()), await akeep(png())
    await sync_to_async(expire_now)(expired)
    not_found(await api.get(f"/v1/documents/{expired}/pictures"))
    not_found(await api.get(f"/v1/documents/{expired}/pictures/1?format=image"))
    assert await sync_to_async(pictures.expire)() == 1
    assert not folder(data_dir, expired).exists()
    assert not await StoredDocument.objects.filter(id=expired).aexists()
    assert not await StoredPicture.objects.filter(document_id=expired).aexists()
    assert (await api.get(f"/v1/documents/{kept}/pictures/1")).status_code == 200


def test_a_document_expires_ttl_seconds_after_it_was_stored(settings):
    with_server(settings, document_pictures_ttl_secs=90)
    before = timezone.now()
    document = StoredDocument.objects.get(id=keep(png()))
    assert before + timedelta(seconds=90) <= document.expires_at <= timezone.now() + timedelta(seconds=90)


async def test_the_store_deletes_expired_documents_when_it_is_used(api, data_dir, monkeypatch):
    monkeypatch.setattr(pictures, "_expiry", pictures._Throttle(0))
    expired, kept = await akeep(png()), await akeep(png())
    await sync_to_async(expire_now)(expired)
    assert (await api.get(f"/v1/documents/{kept}/pictures")).status_code == 200
    assert not folder(data_dir, expired).exists()
    assert not await StoredDocument.objects.filter(id=expired).aexists()


def test_the_expirepictures_command_deletes_expired_documents(data_dir):
    expired, kept = keep(png()), keep(png())
    expire_now(expired)
    out = io.StringIO()
    call_command("expirepictures", stdout=out)
    assert out.getvalue().strip() == "1 expired documents deleted"
    assert not folder(data_dir, expired).exists() and folder(data_dir, kept).exists()


def test_expire_removes_old_folders_no_record_owns(settings, data_dir):
    with_server(settings, document_pictures_ttl_secs=1)
    orphan = folder(data_dir, pictures.new_document_id())
    orphan.mkdir(parents=True)
    (orphan / "1.png").write_bytes(png())
    young = folder(data_dir, pictures.new_document_id())
    young.mkdir()
    old = timezone.now().timestamp() - 10
    os.utime(orphan, (old, old))
    pictures.expire()
    # A young folder may be a document whose record is not committed yet.
    assert not orphan.exists() and young.exists()


# -- the size cap -----------------------------------------------------------------------------------


def test_a_full_store_deletes_the_oldest_documents_first(settings, data_dir):
    image = png()
    with_server(settings, document_pictures_max_bytes=3 * len(image))
    oldest, middle, newest = keep(image), keep(image), keep(image)
    latest = keep(image)
    assert not StoredDocument.objects.filter(id=oldest).exists() and not folder(data_dir, oldest).exists()
    assert set(StoredDocument.objects.values_list("id", flat=True)) == {middle, newest, latest}
    # The document being written is never the one deleted, even when it is the oldest.
    pictures.add_picture(
        middle,
        index=2,
        page=2,
        png=image,
        width=64,
        height=40,
        dpi=None,
        bbox=None,
        page_size=None,
        caption=None,
        ref=None,
    )
    assert set(StoredDocument.objects.values_list("id", flat=True)) == {middle, latest}
    assert not folder(data_dir, newest).exists()
    assert sorted(p.name for p in folder(data_dir, middle).iterdir()) == ["1.png", "2.png"]
    assert StoredDocument.objects.get(id=middle).total_bytes == 2 * len(image)


def test_a_picture_larger_than_the_whole_store_is_refused(settings, data_dir):
    image = png()
    with_server(settings, document_pictures_max_bytes=len(image) + 10)
    other = keep(image)
    document_id = pictures.new_document_id()
    pictures.create_document(document_id, owner=None, filename=None, model="docling")
    big = png(400, 400, "white") + b"\0" * len(image)
    with pytest.raises(pictures.PictureNotStored, match="more than the whole picture store holds") as refused:
        pictures.add_picture(
            document_id,
            index=1,
            page=1,
            png=big,
            width=400,
            height=400,
            dpi=None,
            bbox=None,
            page_size=None,
            caption=None,
            ref=None,
        )
    assert refused.value.status == 400 and refused.value.param == "return_pictures"
    # Nothing was deleted to make room for what could never fit, and nothing was written.
    assert StoredDocument.objects.filter(id=other).exists() and folder(data_dir, other).exists()
    assert (
        not folder(data_dir, document_id).exists()
        and not StoredPicture.objects.filter(document_id=document_id).exists()
    )


# -- a conversion that fails --------------------------------------------------------------------------


def test_discard_leaves_no_file_and_no_record(data_dir):
    document_id = keep(png(), png())
    (folder(data_dir, document_id) / ".picture-left.tmp").write_bytes(b"half a picture")
    pictures.discard_document(document_id)
    assert not folder(data_dir, document_id).exists()
    assert not StoredDocument.objects.filter(id=document_id).exists()
    assert not StoredPicture.objects.filter(document_id=document_id).exists()
    pictures.discard_document(document_id)  # twice, or for a document never stored: no error


def test_a_picture_for_a_document_no_longer_stored_is_refused_and_not_written(data_dir):
    document_id = keep(png())
    pictures.discard_document(document_id)
    with pytest.raises(pictures.PictureNotStored, match="left the picture store"):
        pictures.add_picture(
            document_id,
            index=2,
            page=1,
            png=png(),
            width=64,
            height=40,
            dpi=None,
            bbox=None,
            page_size=None,
            caption=None,
            ref=None,
        )
    assert not folder(data_dir, document_id).exists() or not any(folder(data_dir, document_id).iterdir())


# -- no model, no worker ------------------------------------------------------------------------------


async def test_the_routes_answer_while_the_worker_is_still_staging(api, settings, use_worker):
    staging = use_worker(Worker(settings.HYPNOS))  # never started: staging is not done
    assert not staging.ready
    document_id = await akeep(png())
    assert (await api.get(f"/v1/documents/{document_id}/pictures")).status_code == 200
    assert (await api.get(f"/v1/documents/{document_id}/pictures/1?format=image")).content == png()
    assert (await api.delete(f"/v1/documents/{document_id}")).status_code == 200


async def test_the_routes_never_reach_an_inference_worker(api, settings, monkeypatch):
    with_server(settings, deployment="distributed")

    def no_worker(*args: object) -> None:
        raise AssertionError("a picture route asked for the inference client")

    monkeypatch.setattr(runtime, "client", no_worker)
    document_id = await akeep(png())
    assert (await api.get(f"/v1/documents/{document_id}/pictures")).status_code == 200
    assert (await api.get(f"/v1/documents/{document_id}/pictures/1")).status_code == 200
    assert (await api.delete(f"/v1/documents/{document_id}")).status_code == 200
