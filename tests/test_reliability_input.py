"""Bad input (issue #9): nothing a caller sends makes a process fail.

- HTTP: schemathesis drives every operation of the gateway's `/openapi.json` (positive and
  negative cases, a bounded number each) against the whole stack as separate OS processes: no
  5xx, and every 4xx is the OpenAI envelope (API.md §1.2). The gateway parses its bodies by hand,
  so its OpenAPI document has no request bodies; the body schemas of API.md §1.3 / §2.1 are added
  here before generation (`max_new_tokens` kept small so accepted requests stay short).
- gRPC: malformed and out-of-range messages straight to each stage (wrong dtype sizes and shapes,
  ids and codes out of range, unknown sessions, garbage bytes in bytes fields, bytes that are no
  protobuf at all): INVALID_ARGUMENT / NOT_FOUND (per-row errors on the tower's Step stream), and
  the process keeps serving: the same stream or a new call still works afterwards and a full
  request through the gateway succeeds.
- properties (hypothesis) the prompt builder and chunker tests (test_prompt.py, test_chunking.py)
  do not cover yet: deeply nested and unbalanced tags, instructions, normalization, and lone UTF-16
  surrogates (which JSON can carry as "\\ud800").
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import math
import re
import struct

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from bench.load import stack_addresses
from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
from drama.codec.v1 import codec_pb2, codec_pb2_grpc
from drama.tower.v1 import tower_pb2, tower_pb2_grpc
from gateway.chunking import split_text
from gateway.prompt import PromptBuilder, PromptError
from services.launcher import Stack


CODEBOOKS, VOCAB, SEMANTIC_SIZE, RESIDUAL_SIZE = 10, 352, 64, 32     # the tiny checkpoint
IM_START, IM_END, VOICE = 258, 259, 263
EXAMPLES_PER_OPERATION = 25
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, 0) as running:
        running.start()
        yield running


@pytest.fixture(scope="module")
def addresses(stack):
    return stack_addresses(stack)


def run(coro):
    return asyncio.run(coro)


# --------------------------------------------------------------------------------------------
# HTTP: schemathesis over /openapi.json
# --------------------------------------------------------------------------------------------

SAMPLING = {
    "seed": {"type": "integer", "minimum": 0, "maximum": 4294967295},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0.01, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 4097},
    "repetition_penalty": {"type": "number", "minimum": 1, "maximum": 2},
    "max_new_tokens": {"type": "integer", "minimum": 1, "maximum": 4},
    "chunk_length": {"type": "integer", "minimum": 32, "maximum": 1000},
    "normalize": {"type": "boolean"},
    "latency": {"enum": ["normal", "balanced", "low"]},
}
FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]
SPEECH_BODY = {
    "type": "object", "additionalProperties": False, "required": ["input", "max_new_tokens"],
    "properties": {
        "model": {"enum": ["drama-3", "tts-1", "gpt-4o-mini-tts"]},
        "input": {"type": "string", "minLength": 1, "maxLength": 80},
        "voice": {"anyOf": [{"enum": ["alloy", "default", "nova"]},
                            {"type": "object", "properties": {"id": {"type": "string"}}}]},
        "instructions": {"type": "string", "maxLength": 40},
        "response_format": {"enum": FORMATS},
        "speed": {"type": "number", "minimum": 0.25, "maximum": 4},
        "stream_format": {"enum": ["audio", "sse"]},
        "stream": {"type": "boolean"},
        "sample_rate": {"enum": [8000, 16000, 24000, 44100, 48000]},
        **SAMPLING,
    },
}
CLIP = {
    "type": "object", "required": ["text"],
    "properties": {
        "text": {"type": "string", "maxLength": 40},
        "audio": {"type": "string", "maxLength": 200},
        "audio_path": {"type": "string", "maxLength": 80},
        "vq_codes": {"type": "array", "maxItems": 10,
                     "items": {"type": "array", "maxItems": 3, "items": {"type": "integer"}}},
        "speaker": {"type": "integer", "minimum": 0, "maximum": 15},
    },
}
TTS_BODY = {
    "type": "object", "additionalProperties": False, "required": ["text", "max_new_tokens"],
    "properties": {
        "text": {"type": "string", "minLength": 1, "maxLength": 80},
        "model": {"enum": ["drama-3", "s1"]},
        "references": {"type": "array", "maxItems": 2, "items": CLIP},
        "reference_id": {"anyOf": [{"type": "string"}, {"type": "null"},
                                   {"type": "array", "maxItems": 3, "items": {"type": ["string", "null"]}}]},
        "history": {"type": "array", "maxItems": 2,
                    "items": {"anyOf": [{"type": "object", "required": ["take_id"],
                                         "properties": {"take_id": {"type": "string"}}}, CLIP]}},
        "format": {"enum": FORMATS},
        "sample_rate": {"enum": [16000, 44100, 48000]},
        "streaming": {"type": "boolean"},
        "stream_format": {"enum": ["audio", "sse"]},
        "use_memory_cache": {"enum": ["on", "off"]},
        "prosody": {"type": "object", "properties": {"speed": {"type": "number"}, "volume": {"type": "number"}}},
        **SAMPLING,
    },
}
# Operations that change server state for later cases, or need multipart: left to their own tests.
SKIPPED_OPERATIONS = {("POST", "/v1/audio/voices")}


def with_bodies(document: dict) -> dict:
    """The gateway's OpenAPI document plus the JSON bodies of the two speech routes."""
    document = copy.deepcopy(document)
    for path, schema in (("/v1/audio/speech", SPEECH_BODY), ("/v1/tts", TTS_BODY)):
        document["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": schema}}}
    return document


def check_answer(status: int, body: bytes, what: str) -> None:
    assert status < 500, f"{what}: {status} {body[:300]!r}"
    if status >= 400:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, (what, error)
        assert error["type"] == "invalid_request_error" and error["code"], (what, error)


def exercise(operation, base_url: str, mode, statuses: collections.Counter) -> None:
    """Run up to `EXAMPLES_PER_OPERATION` generated cases of one operation, counting statuses."""

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case):
        if isinstance(case.body, dict) and operation.path in ("/v1/audio/speech", "/v1/tts"):
            # A negative case may drop max_new_tokens; the default (2048 frames) would take minutes.
            case.body.setdefault("max_new_tokens", 4)
        kwargs = case.as_transport_kwargs(base_url=base_url)
        kwargs.pop("cookies", None)
        content = kwargs.pop("data", None)
        if "json" in kwargs:
            content = json.dumps(kwargs.pop("json")).encode()
        what = f"{kwargs['method']} {kwargs['url']} {content!r:.200}"
        with httpx.Client(timeout=30) as client, client.stream(
                kwargs["method"], kwargs["url"], headers=kwargs.get("headers"), params=kwargs.get("params"),
                content=content) as response:
            # A 200 speech body is left unread: closing the connection cancels the session.
            body = response.read() if response.status_code >= 400 else b""
            check_answer(response.status_code, body, what)
        statuses[response.status_code] += 1

    try:
        one()
    except Unsatisfiable:        # negative mode on an operation without anything to get wrong
        assert mode.name == "NEGATIVE", operation.path


def test_schemathesis_no_5xx_and_every_4xx_is_the_envelope(stack):
    """Every operation of /openapi.json, positive and negative cases: no 5xx, 4xx enveloped."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode

    document = httpx.get(f"{stack.url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(with_bodies(document))
    statuses = collections.Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        if (operation.method.upper(), operation.path) in SKIPPED_OPERATIONS:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            exercise(operation, stack.url, mode, statuses)
    print(f"\nschemathesis: {sum(statuses.values())} cases over {len(operations) - len(SKIPPED_OPERATIONS)} "
          f"operations, statuses {dict(sorted(statuses.items()))}")
    assert statuses[200] > 0 and statuses[400] > 0          # both accepted and refused cases ran
    assert httpx.get(f"{stack.url}/ready", timeout=5).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"input": "\ud800 hello"}, "input"),
    ({"input": "hello", "instructions": "calm \udfff"}, "instructions"),
])
def test_lone_surrogate_in_text_is_400(stack, body, param):
    """JSON may escape a lone surrogate; it is refused as invalid_value, not a 500."""
    response = httpx.post(f"{stack.url}/v1/audio/speech", timeout=30, headers={"Content-Type": "application/json"},
                          content=json.dumps({"voice": "alloy", "max_new_tokens": 4, **body}).encode())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_value" and response.json()["error"]["param"] == param


def test_lone_surrogate_in_voice_is_400(stack):
    response = httpx.post(f"{stack.url}/v1/audio/speech", timeout=30, headers={"Content-Type": "application/json"},
                          content=json.dumps({"voice": "\ud800", "input": "hi", "max_new_tokens": 4}).encode())
    assert response.status_code == 400, response.text


# --------------------------------------------------------------------------------------------
# gRPC: malformed messages to each stage
# --------------------------------------------------------------------------------------------

def ids(*values: int) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def codes(frames: int, semantic: int = 1, residual: int = 1) -> bytes:
    block = np.full((frames, CODEBOOKS), residual, dtype="<i2")
    block[:, 0] = semantic
    return block.tobytes()


def generate(**changes) -> backbone_pb2.GenerateRequest:
    request = backbone_pb2.GenerateRequest(
        session_id="sess_bad_input", model="drama-3",
        chunks=[backbone_pb2.Chunk(user_turn=ids(IM_START, *b"user\nhi", IM_END, 10))],
        assistant_open=ids(IM_START, *b"assistant\n", VOICE), assistant_close=ids(IM_END, 10),
        sampling=backbone_pb2.Sampling(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=2))
    for name, value in changes.items():
        target, _, field = name.rpartition("__")
        message = getattr(request, target) if target else request
        if isinstance(value, list):
            del getattr(message, field)[:]
            getattr(message, field).extend(value)
        elif hasattr(value, "DESCRIPTOR"):
            getattr(message, field).CopyFrom(value)
        else:
            setattr(message, field, value)
    return request


BACKBONE_CASES = {
    "no session id": generate(session_id=""),
    "no chunks": generate(chunks=[]),
    "ids not int32-sized": generate(chunks=[backbone_pb2.Chunk(user_turn=b"\x01\x02\x03")]),
    "id past the vocabulary": generate(chunks=[backbone_pb2.Chunk(user_turn=ids(IM_START, 10 ** 9))]),
    "negative id (garbage bytes)": generate(chunks=[backbone_pb2.Chunk(user_turn=b"\xff" * 8)]),
    "empty assistant_open": generate(assistant_open=b""),
    "codes not frame-sized": generate(system=[backbone_pb2.Segment(codes=b"\x00" * 7)]),
    "semantic code out of range": generate(system=[backbone_pb2.Segment(codes=codes(2, semantic=SEMANTIC_SIZE))]),
    "residual code negative": generate(system=[backbone_pb2.Segment(codes=codes(2, residual=-3))]),
    "empty segment": generate(system=[backbone_pb2.Segment()]),
    "history codes garbage": generate(history=[backbone_pb2.HistoryTake(
        segments=[backbone_pb2.Segment(codes=b"\x7f" * 13)])]),
    "temperature NaN": generate(sampling__temperature=math.nan),
    "temperature 5": generate(sampling__temperature=5.0),
    "top_p 2": generate(sampling__top_p=2.0),
    "repetition penalty 3": generate(sampling__repetition_penalty=3.0),
    "max_new_tokens huge": generate(sampling__max_new_tokens=2 ** 31 - 1),
    "top_k negative": generate(sampling__top_k=-5),
    "emit negative": generate(emit=backbone_pb2.Emit(first_message_frames=-1)),
}


async def _generate_status(addr: str, request) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(addr) as channel:
        call = backbone_pb2_grpc.BackboneStub(channel).Generate(request, timeout=20)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


@pytest.mark.parametrize("case", list(BACKBONE_CASES))
def test_backbone_refuses_malformed_generate(addresses, case):
    code = run(_generate_status(addresses["backbone"], BACKBONE_CASES[case]))
    assert code in (INVALID, grpc.StatusCode.OUT_OF_RANGE), code


ENCODE_CASES = {
    "garbage file": codec_pb2.EncodeRequest(audio_file=b"RIFF\x00\x00garbage" * 10),
    "empty file": codec_pb2.EncodeRequest(audio_file=b""),
    "no source": codec_pb2.EncodeRequest(),
    "pcm not float32-sized": codec_pb2.EncodeRequest(pcm=codec_pb2.Pcm(samples=b"\x00" * 7, sample_rate=16000)),
    "pcm zero rate": codec_pb2.EncodeRequest(pcm=codec_pb2.Pcm(samples=b"\x00" * 64000, sample_rate=0)),
    "pcm negative rate": codec_pb2.EncodeRequest(pcm=codec_pb2.Pcm(samples=b"\x00" * 64000, sample_rate=-5)),
    "pcm NaN": codec_pb2.EncodeRequest(pcm=codec_pb2.Pcm(samples=struct.pack("<f", math.nan) * 32000,
                                                         sample_rate=16000)),
    "pcm too short": codec_pb2.EncodeRequest(pcm=codec_pb2.Pcm(samples=b"\x00" * 40, sample_rate=16000)),
}


@pytest.mark.parametrize("case", list(ENCODE_CASES))
def test_codec_refuses_malformed_encode(addresses, case):
    async def call():
        async with grpc.aio.insecure_channel(addresses["codec"]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await codec_pb2_grpc.CodecStub(channel).Encode(ENCODE_CASES[case], timeout=20)
            return failure.value.code()

    assert run(call()) == INVALID


def start(session_id: str = "sess_bad_decode") -> codec_pb2.DecodeRequest:
    return codec_pb2.DecodeRequest(start=codec_pb2.DecodeStart(session_id=session_id, first_chunk_frames=2))


def frames(first: int, n: int, data: bytes) -> codec_pb2.DecodeRequest:
    return codec_pb2.DecodeRequest(frames=codec_pb2.DecodeFrames(first_frame_index=first, n_frames=n, codes=data))


DECODE_CASES = {
    "frames before start": [frames(0, 1, codes(1))],
    "empty message": [start(), codec_pb2.DecodeRequest()],
    "second start": [start(), start()],
    "codes not int16-sized": [start(), frames(0, 1, b"\x00" * 21)],
    "n_frames disagrees": [start(), frames(0, 3, codes(2))],
    "zero frames": [start(), frames(0, 0, b"")],
    "semantic code out of range": [start(), frames(0, 1, codes(1, semantic=32767))],
    "residual code negative": [start(), frames(0, 1, codes(1, residual=-1))],
    "frame index skips": [start(), frames(0, 1, codes(1)), frames(5, 1, codes(1))],
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_codec_refuses_malformed_decode(addresses, case):
    async def call():
        async with grpc.aio.insecure_channel(addresses["codec"]) as channel:
            stream = codec_pb2_grpc.CodecStub(channel).Decode(iter(DECODE_CASES[case]), timeout=20)
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                async for _ in stream:
                    pass
            return failure.value.code()

    assert run(call()) == INVALID


def test_tower_step_row_errors_and_stream_keeps_working(addresses):
    """Bad entries on the Step stream come back as per-row INVALID_ARGUMENT / NOT_FOUND; a good
    step on the same stream still draws a frame; the stream's state is freed when it closes."""
    async def call():
        async with grpc.aio.insecure_channel(addresses["tower"]) as channel:
            stub = tower_pb2_grpc.TowerStub(channel)
            info = await stub.GetInfo(tower_pb2.GetInfoRequest(), timeout=10)
            assert info.hidden_dtype == "float32"
            row_bytes = info.hidden_dim * 4

            def step(step_id, rows, hidden, targets):
                return tower_pb2.StepRequest(step_id=step_id, rows=rows, hidden=hidden, targets=targets)

            good_row = tower_pb2.RowEntry(session_id="sess_ok", first_row=0, n_rows=1, draw=True, seed=3,
                                          temperature=0.8, top_p=0.9)
            requests = [
                # hidden of the wrong size for its rows
                step(1, [good_row], b"\x00" * (row_bytes - 4), np.full((1, CODEBOOKS), -1, "<i2").tobytes()),
                # garbage targets (not int16-sized)
                step(2, [good_row], b"\x00" * row_bytes, b"\x01\x02\x03"),
                # a session this stream never created, continued at row 5
                step(3, [tower_pb2.RowEntry(session_id="sess_unknown", first_row=5, n_rows=1, draw=True)],
                     b"\x00" * row_bytes, np.full((1, CODEBOOKS), -1, "<i2").tobytes()),
                # a good step: one prompt row, one draw
                step(4, [good_row], np.zeros((1, info.hidden_dim), "<f4").tobytes(),
                     np.full((1, CODEBOOKS), -1, "<i2").tobytes()),
            ]
            replies = [reply async for reply in stub.Step(iter(requests), timeout=30)]
            after = await stub.GetInfo(tower_pb2.GetInfoRequest(), timeout=10)
            return info, replies, after

    info, replies, after = run(call())
    assert [r.step_id for r in replies] == [1, 2, 3, 4]
    assert [e.code for e in replies[0].row_errors] == [INVALID.value[0]]
    assert [e.code for e in replies[1].row_errors] == [INVALID.value[0]]
    assert [e.code for e in replies[2].row_errors] == [NOT_FOUND.value[0]]
    assert not replies[3].row_errors
    drawn = np.frombuffer(replies[3].codes, "<i2")
    assert drawn.shape == (CODEBOOKS,)
    assert replies[3].stop[0] or (drawn >= 0).all()         # a frame, or an end of speech
    assert after.open_sessions == info.open_sessions and after.free_slots == info.free_slots


RAW_GARBAGE = b"\x0a\xff\xff\xff\xff\x0f\x01"     # field 1, length-delimited, absurd length


@pytest.mark.parametrize("stage, method, kind", [
    ("codec", "/drama.codec.v1.Codec/GetInfo", "unary_unary"),
    ("codec", "/drama.codec.v1.Codec/Encode", "unary_unary"),
    ("codec", "/drama.codec.v1.Codec/Decode", "stream_stream"),
    ("backbone", "/drama.backbone.v1.Backbone/Generate", "unary_stream"),
    ("tower", "/drama.tower.v1.Tower/Step", "stream_stream"),
])
def test_bytes_that_are_no_protobuf_are_refused(addresses, stage, method, kind):
    """The library answers undecodable request bytes itself (grpc.aio: UNKNOWN "Unexpected
    DecodeError: Error parsing message ..."), before any application code; the stage is unharmed
    (its health still SERVING)."""
    from services.common import grpcutil

    async def call():
        async with grpc.aio.insecure_channel(addresses[stage]) as channel:
            factory = getattr(channel, kind)(method)     # no (de)serializers: raw bytes both ways
            request = iter([RAW_GARBAGE]) if kind.startswith("stream") else RAW_GARBAGE
            try:
                result = factory(request, timeout=10)
                if kind.endswith("stream"):
                    async for _ in result:
                        pass
                else:
                    await result
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return grpc.StatusCode.OK, ""

    code, details = run(call())
    assert code in (INVALID, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (code, details)
    if code != INVALID:
        assert "error parsing message" in details.lower() or "deserializ" in details.lower(), details
    assert run(grpcutil.check_health(addresses[stage], timeout=5)) == "SERVING"


def test_stack_still_serves_after_bad_input(stack, addresses):
    """Runs after the hostile cases above (file order): a full request through every stage works,
    and no stage holds a session."""
    from bench.load import stage_counts

    response = httpx.post(f"{stack.url}/v1/audio/speech", timeout=60,
                          json={"input": "Still here.", "voice": "alloy", "max_new_tokens": 4,
                                "response_format": "pcm"})
    assert response.status_code == 200 and len(response.content) > 0
    counts = run(stage_counts(addresses["backbone"], addresses["tower"], addresses["codec"]))
    assert counts["backbone.open_sessions"] == counts["tower.open_sessions"] == counts["codec.open_sessions"] == 0


# --------------------------------------------------------------------------------------------
# Properties of the prompt builder and chunker (beyond test_prompt.py / test_chunking.py)
# --------------------------------------------------------------------------------------------

TAGS = ["[", "]", "<", ">", "</", "<|", "|>", "<|speaker:1|>", "<|speaker:16|>", "<|speaker:007|>",
        "<whisper>", "</whisper>", "<|im_end|>", "<|semantic:3|>", "\n", ". ", "。", "\ud800", "\udfff"]
ANY_CHARACTER = st.characters(exclude_categories=())        # surrogates included


def nested(depth_leaf):
    """Texts of nested brackets and word tags, balanced or cut at either end."""
    def wrap(inner):
        return st.tuples(st.sampled_from([("[", "]"), ("<w>", "</w>"), ("<whisper>", "</whisper>"),
                                          ("[", ""), ("", "]"), ("<w>", "")]), inner).map(
            lambda pair: pair[0][0] + pair[1] + pair[0][1])
    return st.recursive(depth_leaf, lambda inner: wrap(inner) | st.lists(inner, max_size=3).map("".join),
                        max_leaves=30)


TEXTS = nested(st.text(ANY_CHARACTER, max_size=8) | st.sampled_from(TAGS))


@pytest.fixture(scope="module")
def builder(tiny_checkpoint) -> PromptBuilder:
    return PromptBuilder.from_checkpoint(tiny_checkpoint)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, instructions=st.none() | TEXTS, normalize=st.booleans(),
       chunk_length=st.integers(32, 1000))
def test_builder_refuses_or_builds_any_text(builder, text, instructions, normalize, chunk_length):
    """Any Unicode (lone surrogates, nested and unbalanced tags) in text and instructions either
    builds or is refused with PromptError naming the field; nothing else is raised."""
    try:
        prompt = builder.build(text, instructions=instructions, normalize=normalize, chunk_length=chunk_length)
    except PromptError as exc:
        assert exc.code in ("empty_string", "invalid_value") and exc.param in ("text", "instructions")
        return
    assert prompt.chunks and all(isinstance(i, int) and 0 <= i < VOCAB for ids in prompt.chunks for i in ids)


@settings(max_examples=200, deadline=None)
@given(text=TEXTS, chunk_size=st.integers(1, 200))
def test_chunker_keeps_every_character_of_nested_tags(text, chunk_size):
    """Nested and unbalanced tags: every non-space character survives in order (speaker tags are
    repeated at cuts, so they are set aside), and no chunk is blank."""
    chunks = split_text(text, chunk_size)
    speaker = re.compile(r"<\|speaker:\d+\|>")
    kept = "".join("".join(speaker.sub("", c).split()) for c in chunks)
    assert kept == "".join(speaker.sub("", text).split())
    assert all(c.strip() for c in chunks)
