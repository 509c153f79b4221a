"""Audio out: PCM16 from the codec (44.1 kHz mono) -> time-stretch (speed) -> gain -> streaming
resampler -> container.

    pipeline = AudioPipeline("mp3", 24000, streamed=True)
    body = pipeline.push(pcm_int16) ... + pipeline.finish()

One pipeline serves every response mode (progressive, buffered, SSE), so the bytes of the modes
agree exactly; the only difference the spec allows is the WAV header, whose sizes are 0xFFFFFFFF
("unknown length") when streamed and exact when buffered (`streamed=False`).

Encoders (API.md §1.4):
- pcm: raw s16le.  wav: 44-byte RIFF header + s16le.
- mp3: LAME frames (PyAV), no Xing tag (libsndfile rewrites that tag at close, after a stream
  has sent it; readers then trusted its stale frame count).
- flac: libsndfile into memory (it seeks back to fill STREAMINFO), only ever buffered.
- opus: libopus (PyAV) packets in Ogg pages we write ourselves, so every push ends with a flushed
  page (libsndfile holds pages for ~1 s) and the stream serial is derived from the request seed
  (libsndfile draws a random one), which keeps same-seed requests byte-identical.
- aac: FFmpeg's AAC-LC encoder (PyAV) in ADTS frames we frame ourselves (7-byte headers).
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf
import soxr

CODEC_RATE = 44100

CONTENT_TYPES = {
    "mp3": "audio/mpeg", "opus": "audio/ogg;codecs=opus", "aac": "audio/aac", "flac": "audio/flac",
    "wav": "audio/wav", "pcm": "audio/pcm",
}


def content_type(fmt: str, sample_rate: int) -> str:
    return f"audio/pcm;rate={sample_rate}" if fmt == "pcm" else CONTENT_TYPES[fmt]


def _aac_available() -> bool:
    try:
        import av

        return "aac" in av.codecs_available
    except ImportError:
        return False


AAC_AVAILABLE = _aac_available()


# --------------------------------------------------------------------------------------------
# Sample conversion and resampling
# --------------------------------------------------------------------------------------------

def pcm16_to_float(pcm: np.ndarray) -> np.ndarray:
    return pcm.astype(np.float32) / 32768.0


def float_to_pcm16(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype(np.int16)


class StreamingResampler:
    """soxr's streaming resampler: feeding the signal in any split gives the samples of one
    `ResampleStream` call over the whole signal (checked in tests/test_gateway_audio.py)."""

    def __init__(self, in_rate: int, out_rate: int):
        self.passthrough = in_rate == out_rate
        self._stream = None if self.passthrough else soxr.ResampleStream(
            in_rate, out_rate, 1, dtype="float32", quality="HQ")

    def push(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        if self.passthrough:
            return x
        return self._stream.resample_chunk(np.ascontiguousarray(x, dtype=np.float32), last=last)


class TimeStretcher:
    """Pitch-preserving time-stretch by WSOLA (waveform-similarity overlap-add), streaming.

    Output frame k (window W, hop Hs = W/2, periodic Hann so the windows sum to 1) is cut from the
    input near k * Hs * speed, shifted by up to `tolerance` samples to the offset whose waveform
    best continues the previous frame (cross-correlation), so pitch is kept while the duration
    becomes len / speed. Pure numpy float64: the same input gives the same output in any split.
    """

    def __init__(self, speed: float, window: int = 1024, tolerance: int = 256):
        self.speed = float(speed)
        self.W, self.Hs, self.tol = window, window // 2, tolerance
        n = np.arange(window)
        self.window = 0.5 - 0.5 * np.cos(2 * np.pi * n / window)     # periodic Hann
        # Hs zeros in front make the first real sample sit under a full overlap (dropped again below).
        self._buf = np.zeros(self.Hs)
        self._buf_start = 0          # input index of _buf[0] (input counts the padding)
        self._acc = np.zeros(window)
        self._k = 0                  # next output frame
        self._prev = 0               # input start of the previous frame
        self._input_len = self.Hs
        self._emitted = 0            # output samples produced (padding included)
        self._to_skip = self.Hs

    def _input(self, start: int, length: int) -> np.ndarray:
        """Input samples [start, start + length), zeros outside what was given."""
        out = np.zeros(length)
        lo, hi = max(start, self._buf_start), min(start + length, self._buf_start + len(self._buf))
        if hi > lo:
            out[lo - start:hi - start] = self._buf[lo - self._buf_start:hi - self._buf_start]
        return out

    def push(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        self._buf = np.concatenate([self._buf, np.asarray(x, dtype=np.float64)])
        self._input_len += len(x)
        W, Hs, tol = self.W, self.Hs, self.tol
        target_len = self.Hs + round((self._input_len - self.Hs) / self.speed)
        out = []
        while True:
            nominal = round(self._k * Hs * self.speed)
            need = max(nominal + tol + W, self._prev + Hs + W)
            if not last and need > self._input_len:
                break
            if last and self._k * Hs >= target_len:
                break
            if self._k == 0:
                start = 0
            else:
                natural = self._input(self._prev + Hs, W)
                low = max(0, nominal - tol)
                region = self._input(low, nominal + tol + W - low)
                scores = np.correlate(region, natural, mode="valid")
                start = low + int(np.argmax(scores))
            self._acc += self.window * self._input(start, W)
            out.append(self._acc[:Hs].copy())
            self._acc = np.concatenate([self._acc[Hs:], np.zeros(Hs)])
            self._prev = start
            self._k += 1
            keep_from = min(round(self._k * Hs * self.speed) - tol, self._prev + Hs)
            if keep_from > self._buf_start:
                self._buf = self._buf[keep_from - self._buf_start:]
                self._buf_start = keep_from
        y = np.concatenate(out) if out else np.zeros(0)
        if last:
            y = np.concatenate([y, self._acc[:max(0, target_len - self._emitted - len(y))]])
            y = y[:max(0, target_len - self._emitted)]
        self._emitted += len(y)
        skip = min(self._to_skip, len(y))
        self._to_skip -= skip
        return y[skip:].astype(np.float32)


# --------------------------------------------------------------------------------------------
# Encoders: write(pcm16) -> bytes ready to send, finish() -> the remaining bytes
# --------------------------------------------------------------------------------------------

class PcmEncoder:
    def __init__(self, sample_rate: int, streamed: bool):
        pass

    def write(self, pcm: np.ndarray) -> bytes:
        return pcm.astype("<i2").tobytes()

    def finish(self) -> bytes:
        return b""


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """RIFF/WAVE header for 16-bit mono; `data_bytes=None` writes the 0xFFFFFFFF "unknown" sizes."""
    riff_size = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    data_size = 0xFFFFFFFF if data_bytes is None else data_bytes
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_size))


class WavEncoder:
    """Streamed: header first with unknown sizes. Buffered: the exact header, written at the end
    (the caller prepends nothing; `finish` returns header + all data)."""

    def __init__(self, sample_rate: int, streamed: bool):
        self.sample_rate, self.streamed = sample_rate, streamed
        self._header_sent = False
        self._data = bytearray()

    def write(self, pcm: np.ndarray) -> bytes:
        data = pcm.astype("<i2").tobytes()
        if not self.streamed:
            self._data += data
            return b""
        if not self._header_sent:
            self._header_sent = True
            return wav_header(self.sample_rate, None) + data
        return data

    def finish(self) -> bytes:
        if self.streamed:
            return b"" if self._header_sent else wav_header(self.sample_rate, None)
        return wav_header(self.sample_rate, len(self._data)) + bytes(self._data)


class _AvFrameEncoder:
    """An FFmpeg encoder (PyAV) fed whole frames of `frame_size` samples; the remainder waits for
    the next write and the last partial frame goes out at finish. Returns raw packets."""

    def __init__(self, codec: str, sample_rate: int, sample_format: str, bit_rate: int):
        import av

        self.sample_rate = sample_rate
        self._format = sample_format
        self._ctx = av.CodecContext.create(codec, "w")
        self._ctx.sample_rate = sample_rate
        self._ctx.layout = "mono"
        self._ctx.format = sample_format
        self._ctx.bit_rate = bit_rate
        self._ctx.open()
        self.frame_size = self._ctx.frame_size
        self._pending = np.zeros(0, np.int16)
        self._pts = 0

    def _encode(self, pcm: np.ndarray | None) -> list[bytes]:
        import av

        if pcm is None:
            return [bytes(p) for p in self._ctx.encode(None)]
        samples = pcm16_to_float(pcm) if self._format == "fltp" else pcm
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format=self._format, layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += len(pcm)
        return [bytes(p) for p in self._ctx.encode(frame)]

    def packets(self, pcm: np.ndarray) -> list[bytes]:
        self._pending = np.concatenate([self._pending, pcm.astype(np.int16)])
        n_full = len(self._pending) // self.frame_size * self.frame_size
        out = []
        for start in range(0, n_full, self.frame_size):
            out += self._encode(self._pending[start:start + self.frame_size])
        self._pending = self._pending[n_full:]
        return out

    def flush(self, pad_to_frame: bool = False) -> list[bytes]:
        out = []
        if len(self._pending):
            last = self._pending
            if pad_to_frame:
                last = np.concatenate([last, np.zeros(self.frame_size - len(last), np.int16)])
            out += self._encode(last)
            self._pending = self._pending[:0]
        return out + self._encode(None)


class Mp3Encoder:
    """LAME (PyAV) frames back to back. No Xing/LAME tag: libsndfile's MP3 writer rewrites that
    tag at close, after a stream has already sent it, which left readers with a wrong length."""

    def __init__(self, sample_rate: int, streamed: bool, bitrate_kbps: int | None = None):
        default = 64 if sample_rate < 32000 else 128
        self._enc = _AvFrameEncoder("libmp3lame", sample_rate, "s16p", 1000 * (bitrate_kbps or default))

    def write(self, pcm: np.ndarray) -> bytes:
        return b"".join(self._enc.packets(pcm))

    def finish(self) -> bytes:
        return b"".join(self._enc.flush())


class FlacEncoder:
    """Always buffered: libsndfile fills STREAMINFO by seeking back at close."""

    def __init__(self, sample_rate: int, streamed: bool):
        self._buf = io.BytesIO()
        self._file = sf.SoundFile(self._buf, "w", samplerate=sample_rate, channels=1, format="FLAC",
                                  subtype="PCM_16")

    def write(self, pcm: np.ndarray) -> bytes:
        if len(pcm):
            self._file.write(pcm)
        return b""

    def finish(self) -> bytes:
        self._file.close()
        return self._buf.getvalue()


# ---- Ogg Opus ---------------------------------------------------------------------------------

def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if r & 0x80000000 else (r << 1) & 0xFFFFFFFF
        table.append(r)
    return table


_OGG_CRC = _crc_table()


def ogg_crc(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _OGG_CRC[((crc >> 24) & 0xFF) ^ byte]
    return crc


class OggWriter:
    """Ogg pages (RFC 3533) holding whole packets; each `page()` call writes one or more pages."""

    def __init__(self, serial: int):
        self.serial = serial & 0xFFFFFFFF
        self.sequence = 0

    def page(self, packets: list[bytes], granule: int, bos=False, eos=False) -> bytes:
        out, group, lacing = [], [], []
        for packet in packets:
            laces = [255] * (len(packet) // 255) + [len(packet) % 255]
            if len(lacing) + len(laces) > 255:
                out.append(self._one(group, lacing, -1, bos, False))   # granule -1: no packet ends
                bos, group, lacing = False, [], []
            group.append(packet)
            lacing += laces
        out.append(self._one(group, lacing, granule, bos, eos))
        return b"".join(out)

    def _one(self, packets, lacing, granule, bos, eos) -> bytes:
        flags = (2 if bos else 0) | (4 if eos else 0)
        header = (b"OggS" + bytes([0, flags]) + struct.pack("<qII", granule, self.serial, self.sequence)
                  + b"\0\0\0\0" + bytes([len(lacing)]) + bytes(lacing))
        self.sequence += 1
        page = bytearray(header + b"".join(packets))
        page[22:26] = struct.pack("<I", ogg_crc(bytes(page)))
        return bytes(page)


class OpusEncoder:
    """libopus packets (20 ms) in Ogg pages; every write() ends with a flushed page (RFC 7845)."""

    def __init__(self, sample_rate: int, streamed: bool, bitrate_kbps: int | None = None, serial: int = 0):
        kbps = bitrate_kbps if bitrate_kbps and bitrate_kbps > 0 else 32
        self.sample_rate = sample_rate
        self._enc = _AvFrameEncoder("libopus", sample_rate, "s16", 1000 * kbps)
        self._head = bytes(self._enc._ctx.extradata)            # OpusHead, with pre-skip
        self._pre_skip = struct.unpack("<H", self._head[10:12])[0]
        self._ogg = OggWriter(serial)
        self._samples_in = 0         # input samples, for the final granule
        self._granule = 0            # 48 kHz samples covered by the packets written so far
        self._started = False

    def _headers(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        vendor = b"dramaturg"
        tags = b"OpusTags" + struct.pack("<I", len(vendor)) + vendor + struct.pack("<I", 0)
        return self._ogg.page([self._head], 0, bos=True) + self._ogg.page([tags], 0)

    def write(self, pcm: np.ndarray) -> bytes:
        out = self._headers()
        self._samples_in += len(pcm)
        packets = self._enc.packets(pcm)
        if packets:
            self._granule += len(packets) * self._enc.frame_size * 48000 // self.sample_rate
            out += self._ogg.page(packets, self._granule)
        return out

    def finish(self) -> bytes:
        out = self._headers()
        packets = self._enc.flush(pad_to_frame=True)
        # The last page's granule counts only real input, which trims the padding (RFC 7845 §4.4).
        total = self._pre_skip + self._samples_in * 48000 // self.sample_rate
        return out + self._ogg.page(packets, total, eos=True)


# ---- AAC in ADTS -------------------------------------------------------------------------------

_ADTS_RATES = [96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000]


def adts_header(sample_rate: int, payload_len: int) -> bytes:
    """7-byte ADTS header: MPEG-4, AAC LC, mono, no CRC."""
    length = payload_len + 7
    freq = _ADTS_RATES.index(sample_rate)
    return bytes([
        0xFF, 0xF1,
        (1 << 6) | (freq << 2) | (1 >> 2),       # profile LC (object type 2 - 1), rate, channels hi
        ((1 & 3) << 6) | ((length >> 11) & 3),   # channels lo, frame length hi
        (length >> 3) & 0xFF,
        ((length & 7) << 5) | 0x1F,              # buffer fullness 0x7FF (VBR)
        0xFC,
    ])


class AacEncoder:
    def __init__(self, sample_rate: int, streamed: bool):
        self.sample_rate = sample_rate
        self._enc = _AvFrameEncoder("aac", sample_rate, "fltp", 64000 if sample_rate <= 24000 else 96000)

    def _adts(self, packets: list[bytes]) -> bytes:
        return b"".join(adts_header(self.sample_rate, len(p)) + p for p in packets)

    def write(self, pcm: np.ndarray) -> bytes:
        return self._adts(self._enc.packets(pcm))

    def finish(self) -> bytes:
        return self._adts(self._enc.flush())


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------

class AudioPipeline:
    """PCM16 at `source_rate` in, container bytes out. `streamed` only changes the WAV header."""

    def __init__(self, fmt: str, sample_rate: int, *, streamed: bool, source_rate: int = CODEC_RATE,
                 volume_db: float = 0.0, speed: float = 1.0, mp3_bitrate: int | None = None, opus_bitrate: int | None = None,
                 serial: int = 0):
        self.format, self.sample_rate = fmt, sample_rate
        self.gain = float(10.0 ** (volume_db / 20.0))
        self.resampler = StreamingResampler(source_rate, sample_rate)
        self.stretcher = TimeStretcher(speed) if speed != 1.0 else None
        self.samples_out = 0
        if fmt == "pcm":
            self.encoder = PcmEncoder(sample_rate, streamed)
        elif fmt == "wav":
            self.encoder = WavEncoder(sample_rate, streamed)
        elif fmt == "mp3":
            self.encoder = Mp3Encoder(sample_rate, streamed, mp3_bitrate)
        elif fmt == "flac":
            self.encoder = FlacEncoder(sample_rate, streamed)
        elif fmt == "opus":
            self.encoder = OpusEncoder(sample_rate, streamed, opus_bitrate, serial)
        elif fmt == "aac":
            self.encoder = AacEncoder(sample_rate, streamed)
        else:
            raise ValueError(f"unknown format {fmt!r}")

    def _convert(self, pcm: np.ndarray, last: bool) -> np.ndarray:
        if self.resampler.passthrough and self.gain == 1.0 and self.stretcher is None:
            return pcm.astype(np.int16)
        x = pcm16_to_float(pcm)
        if self.stretcher is not None:
            x = self.stretcher.push(x, last=last)
        if self.gain != 1.0:
            x = x * np.float32(self.gain)
        return float_to_pcm16(self.resampler.push(x, last=last))

    def push(self, pcm: np.ndarray) -> bytes:
        out = self._convert(pcm, last=False)
        self.samples_out += len(out)
        return self.encoder.write(out) if len(out) else b""

    def finish(self) -> bytes:
        tail = self._convert(np.zeros(0, np.int16), last=True)
        self.samples_out += len(tail)
        out = self.encoder.write(tail) if len(tail) else b""
        return out + self.encoder.finish()

    @property
    def duration_s(self) -> float:
        return self.samples_out / self.sample_rate


def encode_all(pcm: np.ndarray, fmt: str, sample_rate: int, **kwargs) -> bytes:
    """One-shot convenience (tests, buffered helpers)."""
    pipeline = AudioPipeline(fmt, sample_rate, streamed=False, **kwargs)
    return pipeline.push(pcm) + pipeline.finish()


# --------------------------------------------------------------------------------------------
# Decoding uploads and references to check them (the codec does the real encode)
# --------------------------------------------------------------------------------------------

class AudioTooLong(ValueError):
    """The clip runs past the allowed length; decoding stopped there."""

    def __init__(self, max_seconds: float):
        super().__init__(f"audio longer than {max_seconds:g} s")
        self.max_seconds = max_seconds


def decode_audio_file(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Any file soundfile or FFmpeg reads -> (mono float32 samples, rate). Raises ValueError, or
    AudioTooLong as soon as more than `max_seconds` have been decoded: a small file can declare
    (or hide) hours of audio, so decoding never runs past the limit (issue #9)."""
    def limit(rate: int) -> int | None:
        return None if max_seconds is None else int(max_seconds * rate) + 1

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            cap = limit(f.samplerate)
            samples = f.read(frames=-1 if cap is None else cap, dtype="float32", always_2d=True)
            rate = int(f.samplerate)
    except Exception:
        samples = None
    if samples is not None:
        if cap is not None and len(samples) >= cap:
            raise AudioTooLong(max_seconds)
        return samples.mean(axis=1), rate
    try:
        import av

        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono")
            chunks, rate, total = [], stream.codec_context.sample_rate, 0
            cap = limit(rate) if rate else None
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += chunks[-1].size
                if cap is not None and total >= cap:
                    raise AudioTooLong(max_seconds)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
        if not chunks or not rate:
            raise ValueError("no audio")
        return np.concatenate(chunks).astype(np.float32), int(rate)
    except AudioTooLong:
        raise
    except Exception as exc:
        raise ValueError(f"undecodable audio: {exc}") from None
