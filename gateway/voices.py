"""The voice registry (API.md §1.3 voice resolution, §1.5).

Three sources, one id space (ids are lower-case):
- builtin: `default` and OpenAI's 13 names; no reference. An OpenAI name is a *seeded voice* (its
  timbre is fixed by a seed derived from the name) unless DRAMA_VOICE_ALIASES maps it to a voice.
- preset: `<id>.<wav|flac|mp3>` + `<id>.txt` (+ optional `<id>.json`) in DRAMA_VOICES_DIR, read at
  start, read-only.
- uploaded: POST /v1/audio/voices, persisted under DRAMA_VOICE_STORE_DIR as `<id>/audio.<ext>` and
  `<id>/voice.json`, reloaded at start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway import errors
from gateway.audio import AudioTooLong, decode_audio_file
from gateway.errors import ApiError
from gateway.validation import OPENAI_VOICES, VOICE_ID_RE

log = logging.getLogger("gateway.voices")

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3")
MIN_SECONDS, MAX_SECONDS = 1.0, 30.0


def seed_for_voice(name: str) -> int:
    """A seed fixed by the voice name, stable across restarts and builds."""
    return int.from_bytes(hashlib.sha256(f"drama-voice:{name}".encode()).digest()[:4], "little")


@dataclass
class Voice:
    id: str
    name: str
    source: str                         # builtin | preset | uploaded
    created_at: int
    transcript: str | None = None
    audio_file: Path | None = None
    duration_s: float | None = None
    speaker_description: str | None = None
    consent: str | None = None
    sha256: str | None = None           # of the audio file's bytes (the codes cache key)

    def to_json(self) -> dict:
        return {"object": "audio.voice", "id": self.id, "name": self.name, "created_at": self.created_at,
                "source": self.source, "has_transcript": bool(self.transcript),
                "duration_s": None if self.duration_s is None else round(self.duration_s, 3),
                "speaker_description": self.speaker_description}

    def audio_bytes(self) -> bytes:
        return self.audio_file.read_bytes()


@dataclass
class ResolvedVoice:
    """What a voice contributes to a request: reference clips and/or a seed."""
    id: str
    voice: Voice | None = None          # a registered voice with a reference clip
    seed: int | None = None             # a seeded voice's seed (a request seed overrides it)


def decode_clip(data: bytes, param: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """decode_audio_file with its failures as the API's 400s for field `param`."""
    try:
        return decode_audio_file(data, max_seconds=max_seconds)
    except AudioTooLong:
        raise ApiError(400, "audio_too_long",
                       f"Invalid '{param}': audio is longer than {max_seconds:g} s.", param) from None
    except ValueError:
        raise ApiError(400, "audio_undecodable", f"Invalid '{param}': the audio could not be decoded.",
                       param) from None


def check_clip(data: bytes, param: str, max_seconds: float = MAX_SECONDS) -> float:
    """Decode to check a clip; returns its duration (API.md §1.5 limits)."""
    samples, rate = decode_clip(data, param, max_seconds)
    duration = len(samples) / rate
    if duration < MIN_SECONDS:
        raise ApiError(400, "audio_too_short",
                       f"Invalid '{param}': audio is {duration:.2f} s, at least {MIN_SECONDS:g} s is required.",
                       param)
    if duration > max_seconds:
        raise ApiError(400, "audio_too_long",
                       f"Invalid '{param}': audio is {duration:.2f} s, at most {max_seconds:g} s is allowed.",
                       param)
    return duration


class VoiceRegistry:
    def __init__(self, voices_dir: Path | None = None, store_dir: Path | None = None, *,
                 max_voices: int = 1000, aliases: dict[str, str] | None = None):
        self.store_dir = store_dir
        self.max_voices = max_voices
        self.aliases = {k.lower(): v.lower() for k, v in (aliases or {}).items()}
        self._lock = threading.Lock()
        self._voices: dict[str, Voice] = {}
        self.on_delete = []             # callbacks(voice): drop cached codes
        started = int(time.time())
        for name in ("default", *OPENAI_VOICES):
            self._voices[name] = Voice(id=name, name=name, source="builtin", created_at=started)
        if voices_dir is not None:
            self._load_presets(Path(voices_dir))
        if store_dir is not None:
            Path(store_dir).mkdir(parents=True, exist_ok=True)
            self._load_uploads(Path(store_dir))
        self.loaded = True

    # ---- loading --------------------------------------------------------------------------

    def _load_presets(self, directory: Path) -> None:
        if not directory.is_dir():
            log.warning("DRAMA_VOICES_DIR %s is not a directory; no presets", directory)
            return
        for audio in sorted(directory.iterdir()):
            if audio.suffix.lower() not in AUDIO_SUFFIXES:
                continue
            voice_id = audio.stem.lower()
            transcript_file = audio.with_suffix(".txt")
            if not VOICE_ID_RE.match(voice_id) or not transcript_file.exists():
                log.warning("skipping preset %s: bad id or no transcript %s", audio, transcript_file.name)
                continue
            meta_file = audio.with_suffix(".json")
            meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
            data = audio.read_bytes()
            try:
                duration = check_clip(data, audio.name)
            except ApiError as exc:
                log.warning("skipping preset %s: %s", audio, exc.message)
                continue
            self._voices[voice_id] = Voice(
                id=voice_id, name=meta.get("name", audio.stem), source="preset",
                created_at=int(audio.stat().st_mtime), transcript=transcript_file.read_text().strip(),
                audio_file=audio, duration_s=duration, speaker_description=meta.get("speaker_description"),
                sha256=hashlib.sha256(data).hexdigest())

    def _load_uploads(self, store: Path) -> None:
        for meta_file in sorted(store.glob("*/voice.json")):
            try:
                meta = json.loads(meta_file.read_text())
                audio = meta_file.parent / meta["audio_file"]
                self._voices[meta["id"]] = Voice(
                    id=meta["id"], name=meta["name"], source="uploaded", created_at=meta["created_at"],
                    transcript=meta["transcript"], audio_file=audio, duration_s=meta["duration_s"],
                    speaker_description=meta.get("speaker_description"), consent=meta.get("consent"),
                    sha256=meta["sha256"])
            except (OSError, KeyError, ValueError) as exc:
                log.warning("skipping stored voice %s: %s", meta_file.parent, exc)

    # ---- queries --------------------------------------------------------------------------

    def list(self) -> list[Voice]:
        with self._lock:
            return sorted(self._voices.values(), key=lambda v: v.id)

    def get(self, voice_id: str) -> Voice | None:
        with self._lock:
            return self._voices.get(voice_id.lower())

    def resolve(self, voice_id: str, param: str = "voice") -> ResolvedVoice:
        """Voice resolution of API.md §1.3: registered voice, OpenAI name (alias or seeded), default."""
        voice_id = voice_id.lower()
        voice = self.get(voice_id)
        if voice is not None and voice.source != "builtin":
            return ResolvedVoice(id=voice.id, voice=voice)
        if voice_id in OPENAI_VOICES:
            target = self.aliases.get(voice_id)
            if target:
                aliased = self.get(target)
                if aliased is None:
                    raise errors.voice_not_found(target, param)
                if aliased.source != "builtin":
                    return ResolvedVoice(id=aliased.id, voice=aliased)
                voice_id = aliased.id
            if voice_id != "default":
                return ResolvedVoice(id=voice_id, seed=seed_for_voice(voice_id))
            return ResolvedVoice(id="default")
        if voice_id == "default":
            return ResolvedVoice(id="default")
        raise errors.voice_not_found(voice_id, param)

    # ---- changes --------------------------------------------------------------------------

    def add(self, *, name: str, audio: bytes, filename: str | None, consent: str, transcript: str,
            speaker_description: str | None) -> Voice:
        voice_id = name.lower()
        duration = check_clip(audio, "audio_sample")
        with self._lock:
            if voice_id in self._voices:
                raise ApiError(409, "voice_already_exists", f"Voice '{voice_id}' already exists.", "name")
            uploaded = sum(1 for v in self._voices.values() if v.source == "uploaded")
            if uploaded >= self.max_voices:
                raise ApiError(400, "voice_limit_reached",
                               f"The voice store is full ({self.max_voices} voices). Delete a voice first.",
                               "name")
            suffix = Path(filename or "").suffix.lower()
            if not suffix or len(suffix) > 6 or not suffix[1:].isalnum():
                suffix = ".bin"
            voice = Voice(id=voice_id, name=name, source="uploaded", created_at=int(time.time()),
                          transcript=transcript, duration_s=duration,
                          speaker_description=speaker_description, consent=consent,
                          sha256=hashlib.sha256(audio).hexdigest())
            if self.store_dir is not None:
                folder = Path(self.store_dir) / voice_id
                folder.mkdir(parents=True, exist_ok=True)
                voice.audio_file = folder / f"audio{suffix}"
                voice.audio_file.write_bytes(audio)
                meta = {"id": voice.id, "name": voice.name, "created_at": voice.created_at,
                        "transcript": transcript, "audio_file": voice.audio_file.name,
                        "duration_s": duration, "speaker_description": speaker_description,
                        "consent": consent, "sha256": voice.sha256}
                tmp = folder / "voice.json.tmp"
                tmp.write_text(json.dumps(meta))
                tmp.replace(folder / "voice.json")
            else:
                voice.audio_file = _MemoryFile(audio)
            self._voices[voice_id] = voice
        return voice

    def delete(self, voice_id: str) -> Voice:
        voice_id = voice_id.lower()
        with self._lock:
            voice = self._voices.get(voice_id)
            if voice is None:
                raise errors.voice_not_found(voice_id, None, status=404)
            if voice.source != "uploaded":
                raise ApiError(400, "voice_not_deletable",
                               f"Voice '{voice_id}' is a {voice.source} voice and cannot be deleted.", None)
            del self._voices[voice_id]
        if self.store_dir is not None:
            shutil.rmtree(Path(self.store_dir) / voice_id, ignore_errors=True)
        for callback in self.on_delete:
            callback(voice)
        return voice


class _MemoryFile:
    """Stands in for a Path when no store directory is configured (tests, ephemeral runs)."""

    def __init__(self, data: bytes):
        self._data = data
        self.name = "audio"

    def read_bytes(self) -> bytes:
        return self._data
