"""What the gateway needs from the checkpoint: config.json only (the tokenizer is the prompt
builder's business). Read once at start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SERVED_MODEL = "drama-3"
# Names accepted as the served model (API.md §1.3, §2.1). Aliases are accepted, never listed.
MODEL_ALIASES = frozenset({
    "drama-3", "fishaudio/drama-3",
    # OpenAI's speech models, so unmodified OpenAI clients work.
    "tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15",
    # Fish Audio's backend names, sent by fish-audio-sdk in the `model` header.
    "speech-1.5", "speech-1.6", "s1", "s1-mini", "s2", "s2-pro",
})


@dataclass(frozen=True)
class ModelInfo:
    num_codebooks: int = 10
    semantic_codebook_size: int = 4096
    residual_codebook_size: int = 1024
    num_speakers: int = 16
    sample_rate: int = 44100
    frame_samples: int = 2048
    max_new_frames: int = 2048          # sampling_defaults.max_new_frames
    temperature: float = 0.8
    top_p: float = 0.9
    text_chunk_size: int = 128
    checkpoint: Path | None = None

    @property
    def frame_rate_hz(self) -> float:
        return self.sample_rate / self.frame_samples

    def codebook_limit(self, index: int) -> int:
        """Exclusive upper bound of codebook `index` (0 is semantic, MODEL.md §7.4)."""
        return self.semantic_codebook_size if index == 0 else self.residual_codebook_size

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path) -> "ModelInfo":
        from services.common.config import load_config

        config = load_config(checkpoint)
        return cls(num_codebooks=config.num_codebooks,
                   semantic_codebook_size=config.semantic_codebook_size,
                   residual_codebook_size=config.residual_codebook_size,
                   num_speakers=config.num_speakers,
                   sample_rate=config.codec.sample_rate,
                   frame_samples=config.codec.frame_samples,
                   max_new_frames=config.sampling.max_new_frames,
                   temperature=config.sampling.temperature,
                   top_p=config.sampling.top_p,
                   text_chunk_size=config.text_chunking.text_chunk_size,
                   checkpoint=Path(checkpoint))
