"""The typed messages between web and worker and their one serialiser (inference/transport/wire.py)."""

from __future__ import annotations

import typing

import msgpack
import pytest
from pydantic import ValidationError

from hypnos_site.errors import ContextLengthExceeded, DeadlineUnmeetable, ServerError
from inference.transport import wire
from inference.transport.entities import Span
from inference.transport.transcripts import Segment, Transcript, Word
from inference.worker.core import CONTROL_OPS
from inference.worker.pool import POOL_OPS

EVENTS = [
    wire.Queued(estimated_wait_ms=12.5),
    wire.Accepted(worker_channel="hypnos.worker.abc"),
    wire.Heartbeat(),
    wire.Started(previous_tier="tier1_gpu_vram", gpu_layers=30, tier_switch_ms=0.0),
    wire.Delta(text="Hel", logprobs=[{"token": "Hel", "logprob": -0.1, "top_logprobs": []}]),
    wire.Reasoning(text="hmm"),
    wire.AudioChunk(data=b"RIFF\x00\x01"),
    wire.VectorChunk(data=[b"\x00\x00\x80?" * 4]),
    wire.Done(
        finish_reason="stop",
        usage=wire.Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=1),
        telemetry={"engine": {"ttft_ms": 3.0}},
        tool_calls=[{"id": "call_1"}],
    ),
    wire.Done(
        result=Transcript(
            text="Hello world.",
            language="en",
            duration_secs=1.5,
            segments=[
                Segment(
                    id=0,
                    seek=0,
                    start=0.0,
                    end=1.5,
                    text=" Hello world.",
                    tokens=[50364, 2425],
                    temperature=0.0,
                    avg_logprob=-0.2,
                    compression_ratio=0.8,
                    no_speech_prob=0.01,
                    words=[Word(word=" Hello", start=0.0, end=0.6)],
                )
            ],
        ),
        telemetry={"audio_secs": 1.5},
    ),
    wire.Done(result=wire.SpeechMade(audio_secs=0.5, samples=12000, sample_rate=24000)),
    wire.Done(result=wire.Embedded(prompt_tokens=7)),
    wire.Done(result={"object": "document", "page_count": 2}),
    wire.DocumentOpened(page_count=3, pages=[2, 3], format="pdf", pipeline="native_pdf", document_id="doc-1"),
    wire.DocumentPage(
        page=2,
        markdown="## Results\n\n<!-- image -->",
        tables=1,
        ms=12.5,
        pictures=[
            wire.PictureFile(path="/spool/p/1.png", width=64, height=32, bbox={"l": 1.0, "coord_origin": "TOPLEFT"})
        ],
    ),
    wire.PageReady(
        page={"page": 2, "markdown": "x", "pictures": 1, "picture_urls": ["/v1/documents/doc-1/pictures/1"]}
    ),
    wire.ImageStep(index=0, step=3, steps=20),
    wire.ImageReady(index=1, path="/spool/out/1.png", seed=8),
    wire.EntitiesFound(index=1, spans=[Span(start=0, end=11, label="person", score=0.97)]),
    wire.Result(result={"models": []}),
    wire.Error.of(ContextLengthExceeded("too long", param="messages")),
]


@pytest.mark.parametrize(
    "event", EVENTS, ids=lambda e: e.kind + ("-" + type(e.result).__name__ if isinstance(e, wire.Done) else "")
)
def test_it_carries_every_event_through_msgpack_unchanged(event):
    # channels-redis packs messages with msgpack: what the serialiser writes must survive it.
    packed = msgpack.unpackb(msgpack.packb(wire.encode_event(event), use_bin_type=True), raw=False)
    assert wire.decode_event(packed) == event


def test_it_carries_a_request_per_modality_through_msgpack_unchanged():
    works = [
        wire.GenerateWork(messages=[{"role": "user", "content": "hi"}], max_tokens=4, images=[b"\x89PNG"]),
        wire.EmbedWork(input=["a", "b"]),
        wire.EmbedWork(input=[[101, 7592, 102], [101, 102]]),
        wire.TranscribeWork(audio="UklGRg==", language="en"),
        wire.SpeechWork(input="Hello.", voice="alloy"),
        wire.ImageWork(
            op="edit",
            prompt="a fox",
            n=2,
            width=64,
            height=64,
            seed=7,
            reference_paths=["/spool/r.png"],
            output_dir="/spool/out",
            max_pixels=1 << 24,
        ),
        wire.DocumentWork(path="/spool/a.pdf", filename="a.pdf", pages="2-3", picture_dir="/spool/pics", max_pages=500),
        wire.EntityWork(input=["Mario Rossi works in Milan."], labels=["person", "city"], threshold=0.4, flat=False),
    ]
    for work in works:
        request = wire.EngineRequest(request_id="req-1", model="m", work=work, deadline_ms=100.0)
        packed = msgpack.unpackb(msgpack.packb(wire.encode_request(request), use_bin_type=True), raw=False)
        assert wire.decode_request(packed) == request


def test_it_refuses_a_malformed_request():
    with pytest.raises(ValidationError):
        wire.decode_request({"type": "engine", "request_id": "r", "model": "m", "work": {"kind": "chat"}})
    with pytest.raises(ValidationError):
        wire.decode_request({"type": "control", "request_id": "r", "op": "format_disk"})
    with pytest.raises(ValidationError):  # strict: a string is no token count
        wire.GenerateWork(messages=[], max_tokens="4")


def test_an_error_event_turns_back_into_its_typed_exception():
    error = DeadlineUnmeetable("too late")
    error.headers = {"Retry-After": "3"}
    again = wire.decode_event(wire.encode_event(wire.Error.of(error))).exception()
    assert type(again) is DeadlineUnmeetable and again.message == "too late"
    assert again.headers["Retry-After"] == "3" and again.status == 503
    context = wire.Error.of(ContextLengthExceeded("long", param="prompt")).exception()
    assert (context.status, context.code, context.param) == (400, "context_length_exceeded", "prompt")
    unknown = wire.Error(error_class="NoSuchError", message="x").exception()
    assert type(unknown) is ServerError


def test_the_control_ops_are_the_workers():
    assert set(typing.get_args(wire.ControlOp)) == set(CONTROL_OPS) | set(POOL_OPS)


def test_the_engines_chat_work_is_the_wires_with_what_the_engine_prepared():
    from inference.engines.base import ChatWork, PreparedPrompt

    work = ChatWork.of(wire.GenerateWork(messages=[], max_tokens=3, raw_prompt="Once", prompt_param="prompt"))
    assert isinstance(work, ChatWork) and work.raw_prompt == "Once" and work.prompt_param == "prompt"
    # The fields are GenerateWork's (written once), plus the worker's own: what the engine
    # prepared, and the request's background priority (EngineRequest.background, set once).
    assert set(ChatWork.model_fields) - set(wire.GenerateWork.model_fields) == {"prepared", "background"}
    prepared = work.model_copy(update={"prepared": PreparedPrompt([1, 2], None)})
    assert prepared.prepared is not None and prepared.prepared.tokens == [1, 2] and work.prepared is None
    assert work.background is False


def test_a_control_op_takes_only_its_own_typed_args():
    move = wire.ControlRequest(request_id="r", op="move", args={"model": "m", "target_tier": "tier2_pinned_ram"})
    assert wire.decode_request(wire.encode_request(move)) == move
    for op, args in [
        ("move", {"model": "m", "target_tier": "tier9"}),
        ("enable", {}),
        ("kv_park", {"max_bytes": "lots"}),
        ("remove_model", {"model": "m", "drain": 1}),
        ("status", {"verbose": True}),
    ]:
        with pytest.raises(ValidationError):
            wire.ControlRequest(request_id="r", op=op, args=args)
    assert set(wire.CONTROL_ARGS) == set(typing.get_args(wire.ControlOp))


async def test_the_client_refuses_bad_control_args_as_a_400():
    from hypnos_site.errors import InvalidRequest
    from inference.transport.client import InferenceClient

    class Unreachable:
        async def submit(self, request):  # type: ignore[no-untyped-def]
            raise AssertionError("a refused control op must not reach a transport")

    with pytest.raises(InvalidRequest) as refused:
        await InferenceClient(Unreachable()).control("move", {"model": "m", "target_tier": "tier9"})  # type: ignore[arg-type]
    assert refused.value.param == "target_tier" and refused.value.status == 400


def test_the_worker_sends_the_events_ready_together_as_one_message_deltas_joined():
    import asyncio

    from inference.worker.channel_server import _take_ready

    queue: asyncio.Queue = asyncio.Queue()
    for event in (wire.Delta(text="lo"), wire.Delta(text="!"), wire.Done(finish_reason="stop"), wire.Heartbeat()):
        queue.put_nowait(event)
    batch = _take_ready(wire.Started(previous_tier="tier1_gpu_vram"), queue)
    assert batch == [
        wire.Started(previous_tier="tier1_gpu_vram"),
        wire.Delta(text="lo!", tokens=2),
        wire.Done(finish_reason="stop"),
    ]
    assert queue.qsize() == 1  # nothing is taken past the end
