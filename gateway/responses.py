"""The speech response: one ASGI response for the three body modes of API.md §1.4.

- progressive: status and headers right away (the session was admitted), then the container bytes
  as PCM arrives; a failure after that raises, so the server closes the connection without the
  terminating chunk and the client sees a truncated body.
- buffered: the whole body with Content-Length and Server-Timing; a failure is still a real error
  status because nothing was sent.
- sse: `speech.audio.delta` events whose base64 `audio` concatenates to the progressive bytes,
  then `speech.audio.done` (or `speech.audio.error`), `: keep-alive` comments until the first delta.

In every mode a task watches `receive()` for `http.disconnect` and cancels the body at once, which
cancels both gRPC calls (well within the 100 ms of §1.4), even while a buffered body is still
being generated.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging

from starlette.responses import Response

from gateway.audio import AudioPipeline
from gateway.errors import ApiError
from gateway.session import SpeechSession

log = logging.getLogger("gateway.responses")

KEEPALIVE_S = 15.0


def _sse(event: str, payload: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class SpeechResponse(Response):
    """Runs the admitted `session` into the body: `pipeline` encodes, `mode` picks the framing."""

    def __init__(self, session: SpeechSession, pipeline: AudioPipeline, mode: str, headers: dict[str, str],
                 media_type: str, *, chunk_index_in_sse: bool = False, on_close=None):
        self.session, self.pipeline, self.mode = session, pipeline, mode
        self.extra_headers = headers
        self.chunk_index_in_sse = chunk_index_in_sse
        self.on_close = on_close
        self.background = None
        self.status_code = 200
        self.media_type = media_type
        self.body = b""
        self.raw_headers = []

    def _headers(self, content_type: str, length: int | None = None, extra: dict | None = None) -> list:
        headers = {**self.extra_headers, **(extra or {}), "content-type": content_type}
        if length is not None:
            headers["content-length"] = str(length)
        else:
            headers["x-accel-buffering"] = "no"
        return [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        body = asyncio.create_task(self._body(scope, send))
        watcher = asyncio.create_task(wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if body not in done:
                log.info("client went away: cancelling session %s", self.session.job.session_id)
                body.cancel()
                await self.session.aclose(asyncio.CancelledError("client disconnected"))
                await asyncio.gather(body, return_exceptions=True)
                return
            body.result()        # re-raises a failure after the first byte: the body is truncated
        finally:
            watcher.cancel()
            if not body.done():          # we were cancelled ourselves (server shutdown)
                body.cancel()
            await self.session.aclose()
            if self.on_close is not None:
                self.on_close()

    async def _body(self, scope, send) -> None:
        if self.mode == "buffered":
            await self._buffered(scope, send)
        elif self.mode == "sse":
            await self._sse(send)
        else:
            await self._progressive(send)

    async def _audio(self):
        """(bytes, audio seconds) as the pipeline produces them, the encoder's tail last."""
        pipeline = self.pipeline
        async for pcm in self.session.pcm_chunks():
            before = pipeline.samples_out
            data = pipeline.push(pcm)
            yield data, (pipeline.samples_out - before) / pipeline.sample_rate
        before = pipeline.samples_out
        yield pipeline.finish(), (pipeline.samples_out - before) / pipeline.sample_rate

    async def _progressive(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers(self.media_type)})
        try:
            async for data, seconds in self._audio():
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    self.session.note_written(seconds)
        except ApiError as exc:
            await self.session.aclose(exc)
            raise RuntimeError(f"speech failed after the first byte: {exc.code}: {exc.message}") from exc
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _buffered(self, scope, send) -> None:
        parts = []
        try:
            async for data, _ in self._audio():
                parts.append(data)
        except ApiError as exc:
            await self.session.aclose(exc)
            await exc.response()(scope, _no_receive, send)
            return
        body = b"".join(parts)
        extra = {"server-timing": self.session.server_timing()}
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._headers(self.media_type, len(body), extra)})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self.session.note_written(self.pipeline.duration_s)

    async def _sse(self, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._headers("text/event-stream")})
        session, pipeline = self.session, self.pipeline
        audio = self._audio().__aiter__()
        first = True
        step = None
        try:
            while True:
                step = asyncio.ensure_future(audio.__anext__())
                while first:
                    done, _ = await asyncio.wait({step}, timeout=KEEPALIVE_S)
                    if done:
                        break
                    await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
                try:
                    data, seconds = await step
                except StopAsyncIteration:
                    break
                if not data:
                    continue
                first = False
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii"),
                         "sample_rate": pipeline.sample_rate}
                if self.chunk_index_in_sse:
                    event["chunk_index"] = session.chunk_index
                await send({"type": "http.response.body", "body": _sse("speech.audio.delta", event),
                            "more_body": True})
                session.note_written(seconds)
            result = session.result
            done_event = {"type": "speech.audio.done", "usage": result.usage(), "take_id": result.take_id,
                          "seed": result.seed, "audio_duration_s": round(pipeline.duration_s, 4),
                          "finish_reason": result.finish_reason}
            await send({"type": "http.response.body", "body": _sse("speech.audio.done", done_event),
                        "more_body": False})
        except ApiError as exc:
            await session.aclose(exc)
            error_event = {"type": "speech.audio.error", "error": exc.body()["error"]}
            await send({"type": "http.response.body", "body": _sse("speech.audio.error", error_event),
                        "more_body": False})
        finally:
            if step is not None and not step.done():
                step.cancel()


async def wait_disconnect(receive) -> None:
    """Returns when the client disconnects (the request body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _no_receive():
    return {"type": "http.disconnect"}
