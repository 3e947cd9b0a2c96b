"""The pieces of a document conversion that need no engine: the request's fields, the pages
asked for, the pictures' descriptions in the Markdown, and the job's progress feed."""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest
from django.http import QueryDict
from django.test import override_settings

from hypnos_site.errors import InvalidRequest, ModelNotAvailable, ServerError
from inference.jobs import feed as jobs
from inference.jobs.documents import insert_descriptions
from inference.transport.wire import DocumentOpened, Done, Error, Heartbeat, PageReady, encode_event
from inference.web.openai.serving_documents import _decode_inline, document_request
from inference.worker.documents import page_numbers


def test_pages_are_one_page_or_an_inclusive_range_inside_the_document():
    assert page_numbers(None, 3) == [1, 2, 3]
    assert page_numbers("2", 3) == [2]
    assert page_numbers(" 2-3 ", 5) == [2, 3]
    for bad in ("0", "3-2", "a", "1-", "-2", "1-2-3"):
        with pytest.raises(InvalidRequest) as refused:
            page_numbers(bad, 5)
        assert refused.value.param == "pages"
    with pytest.raises(InvalidRequest, match="outside the document, which has 3 pages"):
        page_numbers("2-4", 3)


def test_each_description_goes_under_its_own_placeholder_in_order():
    markdown = "# T\n\n<!-- image -->\n\ntext\n\n<!-- image -->\n"
    described = insert_descriptions(markdown, ["A red square.", "A chart."])
    assert described == (
        "# T\n\n<!-- image -->\n\n> **Picture:** A red square.\n\ntext\n\n<!-- image -->\n\n> **Picture:** A chart.\n"
    )
    # Fewer descriptions than pictures leaves the rest as they were.
    assert insert_descriptions(markdown, ["One."]).count("**Picture:**") == 1


def _form(**fields: str) -> QueryDict:
    form = QueryDict(mutable=True)
    for name, value in fields.items():
        form[name] = value
    return form


def test_multipart_booleans_take_the_spellings_the_spec_lists():
    for true, false in (("true", "false"), ("1", "0"), ("yes", "no"), ("ON", "Off")):
        body, _ = document_request(_form(model="docling", url="http://x/a.pdf", ocr=false, stream=true))
        assert body.ocr is False and body.stream is True
    with pytest.raises(InvalidRequest) as refused:
        document_request(_form(model="docling", url="http://x/a.pdf", return_pictures="maybe"))
    assert refused.value.param == "return_pictures"


def test_the_document_comes_as_exactly_one_of_file_or_url():
    with pytest.raises(InvalidRequest) as refused:
        document_request({"model": "docling"})
    assert refused.value.param == "file"
    with pytest.raises(InvalidRequest):
        document_request({"model": "docling", "file": "aGk=", "url": "http://x/a.pdf"})
    with pytest.raises(InvalidRequest) as refused:
        document_request({"model": "docling", "file": "aGk=", "filename": "../../etc/passwd"})
    assert refused.value.param == "filename"
    with pytest.raises(InvalidRequest) as refused:
        document_request({"model": "docling", "file": "aGk=", "output_format": "docx"})
    assert refused.value.param == "output_format"


def test_an_inline_file_is_base64_or_a_base64_data_uri_within_the_limit():
    data = b"%PDF-1.4 hello"
    encoded = base64.b64encode(data).decode()
    assert _decode_inline(encoded, 1000) == data
    assert _decode_inline(f"data:application/pdf;base64,{encoded}", 1000) == data
    with pytest.raises(InvalidRequest, match="not valid base64"):
        _decode_inline("not base64!", 1000)
    with pytest.raises(InvalidRequest, match="must be base64"):
        _decode_inline("data:text/plain,hello", 1000)
    with pytest.raises(InvalidRequest) as refused:
        _decode_inline(base64.b64encode(b"x" * 4000).decode(), 1000)
    assert refused.value.status == 400 and refused.value.code == "payload_too_large"


def _message(seq: int, event: object) -> dict:
    return {"type": "job.event", "seq": seq, "event": encode_event(event)}


async def test_the_feed_hands_over_events_from_another_thread_in_order():
    feed = await jobs.JobFeed.open()
    events = [
        Heartbeat(),
        DocumentOpened(page_count=2, pages=[1, 2], format="pdf", pipeline="native_pdf"),
        PageReady(page={"page": 1}),
        Done(result={"object": "document"}),
    ]

    def send_all() -> None:
        for seq, event in enumerate(events):
            asyncio.run(jobs.local_channels.send(feed.channel, _message(seq, event)))

    threading.Thread(target=send_all).start()
    got = [await feed.next_event() for _ in range(3)]
    assert got == events[1:]  # the heartbeat is taken by the feed
    feed.close()


async def test_the_feed_raises_the_jobs_error_and_notices_a_lost_message():
    feed = await jobs.JobFeed.open()
    await jobs.local_channels.send(feed.channel, _message(0, Error.of(InvalidRequest("bad pdf", param="file"))))
    with pytest.raises(InvalidRequest, match="bad pdf"):
        await feed.next_event()
    await jobs.local_channels.send(feed.channel, _message(5, Heartbeat()))
    with pytest.raises(ServerError, match="lost"):
        await feed.next_event()
    feed.close()


async def test_a_job_nobody_takes_is_a_503_not_a_hang(settings):
    settings.HYPNOS = settings.HYPNOS.model_copy(
        update={"server": settings.HYPNOS.server.model_copy(update={"job_pickup_timeout_secs": 0.2})}
    )
    feed = await jobs.JobFeed.open()
    with pytest.raises(ModelNotAvailable, match="No job worker took the conversion"):
        await feed.next_event()
    feed.close()


async def test_a_started_job_that_falls_silent_ends_with_an_error(settings):
    settings.HYPNOS = settings.HYPNOS.model_copy(
        update={"server": settings.HYPNOS.server.model_copy(update={"job_silence_secs": 0.2})}
    )
    feed = await jobs.JobFeed.open()
    await jobs.local_channels.send(feed.channel, _message(0, Heartbeat()))
    with pytest.raises(ModelNotAvailable, match="stopped reporting"):
        await feed.next_event()
    feed.close()


async def test_sending_to_a_closed_feed_is_dropped():
    feed = await jobs.JobFeed.open()
    feed.close()
    await jobs.local_channels.send(feed.channel, _message(0, Heartbeat()))  # no error, nobody reads


@override_settings()
def test_the_embedded_deployment_runs_jobs_eagerly_with_no_broker():
    from django.conf import settings

    assert settings.CELERY_TASK_ALWAYS_EAGER is True
    assert settings.CELERY_BROKER_URL == "memory://"
    assert settings.CELERY_RESULT_BACKEND == "django-db"
