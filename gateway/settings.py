"""Gateway settings: one dataclass read from the DRAMA_* environment (API.md §1, §2, §3.2).

`Settings.from_env()` reads them once; the app keeps the instance on `app.state.settings` and
routes get it through `dependencies.get_settings`, which tests override.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


def _env_int(env, name: str, default: int) -> int:
    raw = env.get(name)
    return default if raw in (None, "") else int(raw)


def _env_float(env, name: str, default: float) -> float:
    raw = env.get(name)
    return default if raw in (None, "") else float(raw)


def _env_bool(env, name: str, default: bool = False) -> bool:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _env_list(env, name: str) -> list[str]:
    return [item.strip() for item in (env.get(name) or "").split(",") if item.strip()]


def _env_path(env, name: str) -> Path | None:
    raw = env.get(name)
    return Path(raw) if raw else None


@dataclass
class Settings:
    checkpoint: Path | None = None                 # DRAMA_CHECKPOINT (config.json + tokenizer.json)
    host: str = "127.0.0.1"                        # DRAMA_HOST
    port: int = 8000                               # DRAMA_PORT
    backbone_addr: str = "localhost:50051"         # DRAMA_BACKBONE_ADDR
    codec_addr: str = "localhost:50053"            # DRAMA_CODEC_ADDR
    api_keys: list[str] = field(default_factory=list, repr=False)  # DRAMA_API_KEYS; never logged
    metrics_require_auth: bool = False             # DRAMA_METRICS_REQUIRE_AUTH
    cors_origins: list[str] = field(default_factory=list)          # DRAMA_CORS_ORIGINS
    openai_max_input_chars: int = 4096             # DRAMA_OPENAI_MAX_INPUT_CHARS (<= 32768)
    max_text_chars: int = 32768                    # DRAMA_MAX_TEXT_CHARS
    voices_dir: Path | None = None                 # DRAMA_VOICES_DIR (presets, read at start)
    voice_store_dir: Path | None = None            # DRAMA_VOICE_STORE_DIR (uploads)
    max_voices: int = 1000                         # DRAMA_MAX_VOICES
    voice_aliases: dict[str, str] = field(default_factory=dict)    # DRAMA_VOICE_ALIASES (JSON)
    take_ttl_s: float = 3600.0                     # DRAMA_TAKE_TTL_S
    take_store_mb: float = 256.0                   # DRAMA_TAKE_STORE_MB
    request_timeout_s: float = 900.0               # DRAMA_REQUEST_TIMEOUT_S (gRPC deadline)
    queue_timeout_s: float = 30.0                  # DRAMA_QUEUE_TIMEOUT_S (admission wait)
    allowed_local_media_path: Path | None = None   # DRAMA_ALLOWED_LOCAL_MEDIA_PATH
    allowed_media_domains: list[str] = field(default_factory=list)  # DRAMA_ALLOWED_MEDIA_DOMAINS
    trace_content: bool = False                    # DRAMA_TRACE_CONTENT
    served_model: str = "drama-3"

    def __post_init__(self):
        if not 1 <= self.openai_max_input_chars <= 32768:
            raise ValueError("DRAMA_OPENAI_MAX_INPUT_CHARS must be between 1 and 32768")
        self.voice_aliases = {k.lower(): v.lower() for k, v in self.voice_aliases.items()}

    @classmethod
    def from_env(cls, env=None, **overrides) -> "Settings":
        env = os.environ if env is None else env
        aliases = env.get("DRAMA_VOICE_ALIASES")
        values = dict(
            checkpoint=_env_path(env, "DRAMA_CHECKPOINT"),
            host=env.get("DRAMA_HOST") or "127.0.0.1",
            port=_env_int(env, "DRAMA_PORT", 8000),
            backbone_addr=env.get("DRAMA_BACKBONE_ADDR") or "localhost:50051",
            codec_addr=env.get("DRAMA_CODEC_ADDR") or "localhost:50053",
            api_keys=_env_list(env, "DRAMA_API_KEYS"),
            metrics_require_auth=_env_bool(env, "DRAMA_METRICS_REQUIRE_AUTH"),
            cors_origins=_env_list(env, "DRAMA_CORS_ORIGINS"),
            openai_max_input_chars=_env_int(env, "DRAMA_OPENAI_MAX_INPUT_CHARS", 4096),
            max_text_chars=_env_int(env, "DRAMA_MAX_TEXT_CHARS", 32768),
            voices_dir=_env_path(env, "DRAMA_VOICES_DIR"),
            voice_store_dir=_env_path(env, "DRAMA_VOICE_STORE_DIR"),
            max_voices=_env_int(env, "DRAMA_MAX_VOICES", 1000),
            voice_aliases=json.loads(aliases) if aliases else {},
            take_ttl_s=_env_float(env, "DRAMA_TAKE_TTL_S", 3600.0),
            take_store_mb=_env_float(env, "DRAMA_TAKE_STORE_MB", 256.0),
            request_timeout_s=_env_float(env, "DRAMA_REQUEST_TIMEOUT_S", 900.0),
            queue_timeout_s=_env_float(env, "DRAMA_QUEUE_TIMEOUT_S", 30.0),
            allowed_local_media_path=_env_path(env, "DRAMA_ALLOWED_LOCAL_MEDIA_PATH"),
            allowed_media_domains=[d.lower() for d in _env_list(env, "DRAMA_ALLOWED_MEDIA_DOMAINS")],
            trace_content=_env_bool(env, "DRAMA_TRACE_CONTENT"),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
