"""Gateway audio out (API.md §1.4): the streaming resampler, the six containers, WAV headers,
Ogg pages flushed per push, ADTS framing, and streamed == buffered bytes."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest
import soundfile as sf
import soxr

from gateway.audio import (AudioPipeline, StreamingResampler, TimeStretcher, adts_header, encode_all, float_to_pcm16,
                           ogg_crc, pcm16_to_float)

RATE = 44100
SPLITS = [2048 * 2, 2048 * 8, 3000, 2048 * 8, 1, 10 ** 9]   # awkward, like codec messages


def tone(seconds=1.0, freq=440.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * 32767 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def push_in_pieces(pipeline: AudioPipeline, pcm: np.ndarray) -> list[bytes]:
    out, i = [], 0
    for n in SPLITS:
        out.append(pipeline.push(pcm[i:i + n]))
        i += n
    out.append(pipeline.finish())
    return out


def read_back(data: bytes, fmt: str, rate: int) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, rate
    if fmt in ("opus", "aac"):
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
            return np.concatenate(frames), stream.rate
    samples, got_rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples, got_rate


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 48000])
def test_streaming_resampler_equals_one_shot(rate):
    """Chunked resampling gives exactly the samples of one call over the whole signal."""
    x = pcm16_to_float(tone(0.7))
    one = soxr.ResampleStream(RATE, rate, 1, dtype="float32", quality="HQ").resample_chunk(x, last=True)
    resampler, parts, i = StreamingResampler(RATE, rate), [], 0
    for n in SPLITS:
        parts.append(resampler.push(x[i:i + n]))
        i += n
    parts.append(resampler.push(np.zeros(0, np.float32), last=True))
    assert np.array_equal(np.concatenate(parts), one)
    assert abs(len(one) - len(x) * rate / RATE) <= 1


def test_pcm16_conversion_round_trips():
    pcm = np.array([-32768, -1, 0, 1, 32767], np.int16)
    assert np.array_equal(float_to_pcm16(pcm16_to_float(pcm)), pcm)


@pytest.mark.parametrize("fmt,rate", [("pcm", 24000), ("wav", 24000), ("mp3", 24000), ("mp3", 44100),
                                      ("flac", 44100), ("opus", 48000), ("opus", 24000), ("aac", 24000),
                                      ("aac", 44100), ("wav", 8000)])
def test_every_format_reads_back_at_its_rate(fmt, rate):
    pcm = tone(1.0)
    data = b"".join(push_in_pieces(AudioPipeline(fmt, rate, streamed=fmt != "flac"), pcm))
    samples, got_rate = read_back(data, fmt, rate)
    assert got_rate == (48000 if fmt == "opus" else rate)      # Ogg Opus always decodes at 48 kHz
    duration = len(samples) / got_rate
    assert 0.95 <= duration <= 1.15, duration                  # encoder priming/padding only
    assert np.sqrt(np.mean(samples ** 2)) > 0.1                 # the tone, not silence


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "opus", "aac", "flac"])
def test_streamed_equals_buffered(fmt):
    """The same pushes give the same bytes whether the body is streamed or buffered."""
    pcm = tone(0.8)
    streamed = b"".join(push_in_pieces(AudioPipeline(fmt, 24000, streamed=True), pcm))
    buffered = b"".join(push_in_pieces(AudioPipeline(fmt, 24000, streamed=False), pcm))
    assert streamed == buffered


def test_pcm_in_pieces_equals_one_shot():
    pcm = tone(0.8)
    assert b"".join(push_in_pieces(AudioPipeline("pcm", 22050, streamed=True), pcm)) == encode_all(pcm, "pcm", 22050)


def test_wav_streamed_header_has_unknown_sizes_and_buffered_exact():
    pcm = tone(0.5)
    streamed = b"".join(push_in_pieces(AudioPipeline("wav", 16000, streamed=True), pcm))
    buffered = encode_all(pcm, "wav", 16000)
    assert struct.unpack("<I", streamed[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", streamed[40:44])[0] == 0xFFFFFFFF
    data_bytes = len(buffered) - 44
    assert struct.unpack("<I", buffered[40:44])[0] == data_bytes and struct.unpack("<I", buffered[4:8])[0] == 36 + data_bytes
    assert streamed[44:] == buffered[44:] and streamed[8:40] == buffered[8:40]
    assert sf.info(io.BytesIO(buffered)).frames == data_bytes // 2


def _ogg_pages(data: bytes) -> list[dict]:
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 4] == b"OggS"
        nseg = data[pos + 26]
        size = 27 + nseg + sum(data[pos + 27:pos + 27 + nseg])
        page = data[pos:pos + size]
        crc = struct.unpack("<I", page[22:26])[0]
        assert ogg_crc(page[:22] + b"\0\0\0\0" + page[26:]) == crc
        pages.append({"flags": page[5], "granule": struct.unpack("<q", page[6:14])[0],
                      "serial": struct.unpack("<I", page[14:18])[0]})
        pos += size
    return pages


def test_opus_pages_are_flushed_per_push_and_serial_is_the_seed():
    pcm = tone(1.0)
    pipeline = AudioPipeline("opus", 24000, streamed=True, serial=1234)
    pieces = push_in_pieces(pipeline, pcm)
    for piece in pieces:
        if piece:
            _ogg_pages(piece)              # every push returns whole pages (checked by the parser)
    pages = _ogg_pages(b"".join(pieces))
    assert pages[0]["flags"] & 2 and pages[-1]["flags"] & 4          # BOS, EOS
    assert {p["serial"] for p in pages} == {1234}
    granules = [p["granule"] for p in pages[2:]]
    assert granules == sorted(granules) and granules[-1] == 312 + 48000    # pre-skip + 1 s at 48 kHz
    again = b"".join(push_in_pieces(AudioPipeline("opus", 24000, streamed=True, serial=1234), pcm))
    assert again == b"".join(pieces)


def test_adts_header_fields():
    header = adts_header(24000, 100)
    assert header[0] == 0xFF and header[1] == 0xF1
    assert (header[2] >> 6) == 1 and ((header[2] >> 2) & 0xF) == 6        # LC, 24 kHz index
    length = ((header[3] & 3) << 11) | (header[4] << 3) | (header[5] >> 5)
    assert length == 107


def test_volume_gain_scales_samples():
    pcm = tone(0.3)
    loud = np.frombuffer(encode_all(pcm, "pcm", RATE, volume_db=6.0), "<i2")
    ratio = np.abs(loud.astype(float)).max() / np.abs(pcm.astype(float)).max()
    assert 1.95 < ratio < 2.05


@pytest.mark.parametrize("speed", [0.25, 0.8, 1.5, 4.0])
def test_time_stretch_keeps_pitch_and_scales_duration(speed):
    t = np.arange(RATE) / RATE
    x = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    out = TimeStretcher(speed).push(x, last=True)
    assert len(out) == round(len(x) / speed)
    core = out[2048:-2048]
    spectrum = np.abs(np.fft.rfft(core * np.hanning(len(core))))
    assert abs(np.argmax(spectrum) * RATE / len(core) - 220) < 3          # same pitch
    assert abs(np.abs(core).max() - 0.3) < 0.01                           # no gain change


def test_time_stretch_is_split_invariant():
    x = pcm16_to_float(tone(1.0))
    one = TimeStretcher(1.3).push(x, last=True)
    stretcher, parts, i = TimeStretcher(1.3), [], 0
    for n in SPLITS:
        parts.append(stretcher.push(x[i:i + n]))
        i += n
    parts.append(stretcher.push(np.zeros(0, np.float32), last=True))
    assert np.array_equal(np.concatenate(parts), one)


def test_every_allowed_rate_of_every_format_encodes():
    """The API's rate sets (§1.4) are all accepted by the encoders (e.g. AAC and MP3 at low rates)."""
    from gateway.schemas import SAMPLE_RATES

    pcm = tone(0.3)
    for fmt, rates in SAMPLE_RATES.items():
        for rate in rates:
            assert len(encode_all(pcm, fmt, rate)) > 0, (fmt, rate)
