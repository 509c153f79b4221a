"""The prompt builder (MODEL.md §8.2-8.3): caller text, references and previous takes in, token
ids and codes out, in the pieces the backbone's `Generate` takes (API.md §3.4).

    builder = PromptBuilder.from_checkpoint(checkpoint_dir)
    builder.validate_text(text, "input")               # PromptError on forged or bad tags
    prompt = builder.build(text, references=[RefPart(transcript, codes, speaker=0)])
    prompt.system, prompt.history, prompt.chunks, prompt.assistant_open, prompt.assistant_close

Each text part is tokenized on its own with `add_special_tokens=False` and the id lists are
concatenated; our template strings contain special tokens (`<|im_start|>`, `<|voice|>`), which the
tokenizer maps to their single ids. Caller text may hold speaker tags but no other special token
(`validate_text`), so a script cannot forge turns or audio rows.

Codes are int64 `[N, T]` (codebook-major) here; the gRPC edge converts them to int16 `[T, N]`.

Choices of ours, beyond the spec:
- `normalize` applies to every spoken text (the input, reference transcripts, previous takes'
  texts), never to instructions; `normalize_text` is idempotent, so a take's text that was already
  normalized is unchanged.
- Instructions go into the first chunk after chunking, so they never move chunk boundaries.
- `text_tokens` counts the ids of the chunk texts (speaker tags and instructions included, the
  turn template excluded); `audio_frames` counts the frames of the references and previous takes.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

import torch
from tokenizers import Tokenizer

from gateway.chunking import SPECIAL_TAG, SPEAKER_TAG, split_text
from gateway.normalize import normalize_text
from services.common.config import DramaConfig, load_config

MAX_SPEAKERS = 16

# MODEL.md §8.1: special tokens other than speaker tags never come from a caller.
RESERVED_TOKENS = frozenset({
    "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|phoneme_start|>",
    "<|phoneme_end|>", "<|text|>", "<|voice|>", "<|interleave|>", "<|audio_start|>",
    "<|audio_end|>", "<|audio_pad|>",
})
SEMANTIC_TAG = re.compile(r"<\|semantic:\d+\|>")
# A JSON string may escape a lone UTF-16 surrogate ("\ud800"); it is no character, and the
# tokenizer raises TypeError on it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# Template strings of MODEL.md §8.2, each tokenized as its own part.
SYSTEM_OPEN = "<|im_start|>system\n"
SYSTEM_INTRO = "convert the provided text to speech reference to the following:\n\nText:\n"
SYSTEM_SPEECH = "\n\nSpeech:\n"
USER_OPEN = "<|im_start|>user\n"
ASSISTANT_OPEN = "<|im_start|>assistant\n<|voice|>"
TURN_CLOSE = "<|im_end|>\n"


class PromptError(ValueError):
    """A caller text the prompt cannot be built from; maps to HTTP 400 with `code` and `param`."""

    def __init__(self, code: str, param: str | None, message: str):
        super().__init__(message)
        self.code = code
        self.param = param
        self.message = message

    def __repr__(self) -> str:
        return f"PromptError({self.code!r}, {self.param!r}, {self.message!r})"


@dataclass
class RefPart:
    """A reference clip: its transcript and codes `[N, T]`, for speaker `speaker`."""
    text: str
    codes: torch.Tensor
    speaker: int = 0


@dataclass
class TakePart:
    """A previous take: the text it spoke and the codes `[N, T]` it produced."""
    text: str
    codes: torch.Tensor
    speaker: int = 0


@dataclass
class Segment:
    """One piece of a turn: text rows (`tokens`) or audio rows (`codes` `[N, T]` int64)."""
    tokens: list[int] | None = None
    codes: torch.Tensor | None = None

    def __post_init__(self):
        if (self.tokens is None) == (self.codes is None):
            raise ValueError("a Segment holds exactly one of tokens and codes")

    @property
    def num_rows(self) -> int:
        return len(self.tokens) if self.tokens is not None else int(self.codes.shape[1])


class FlatRows(NamedTuple):
    """A chunk's whole timeline: `token_ids[r]` is row r's id (an audio row has the id of its
    semantic code), `frames[:, r]` its frame, -1 on text rows. frames is `[N, R]` int64."""
    token_ids: list[int]
    frames: torch.Tensor


@dataclass
class BuiltPrompt:
    system: list[Segment]               # empty without references
    history: list[list[Segment]]        # one per previous take: its user and assistant turns
    chunks: list[list[int]]             # user turn ids of each text chunk
    assistant_open: list[int]
    assistant_close: list[int]
    chunk_texts: list[str]              # the speaker-tagged text of each chunk
    text_tokens: int
    audio_frames: int
    semantic_start_token_id: int
    num_codebooks: int
    speakers: list[int] = field(default_factory=list)  # speaker indices the text uses

    def flat_rows(self, chunk_index: int = 0, previous_codes: torch.Tensor | None = None) -> FlatRows:
        """The rows of chunk `chunk_index`'s timeline as MODEL.md §8.2 and API.md §3.4 lay it out:
        system ‖ history ‖ (previous chunk's turns, for chunk_index > 0) ‖ user turn ‖ assistant
        open. `previous_codes` `[N, T]` are the frames generated for the previous chunk; no
        history is dropped here (the context budget is the backbone's)."""
        segments = list(self.system)
        for take in self.history:
            segments += take
        if chunk_index > 0:
            if previous_codes is None:
                raise ValueError("chunk_index > 0 needs the previous chunk's generated codes")
            segments += [Segment(tokens=self.chunks[chunk_index - 1] + self.assistant_open),
                         Segment(codes=torch.as_tensor(previous_codes, dtype=torch.int64)),
                         Segment(tokens=self.assistant_close)]
        segments.append(Segment(tokens=self.chunks[chunk_index] + self.assistant_open))

        token_ids: list[int] = []
        frame_columns = []
        for segment in segments:
            if segment.tokens is not None:
                token_ids += segment.tokens
                frame_columns.append(torch.full((self.num_codebooks, len(segment.tokens)), -1,
                                                dtype=torch.int64))
            else:
                token_ids += (segment.codes[0] + self.semantic_start_token_id).tolist()
                frame_columns.append(segment.codes)
        return FlatRows(token_ids, torch.cat(frame_columns, dim=1))


def starts_with_speaker_tag(text: str) -> bool:
    return SPEAKER_TAG.match(text.lstrip()) is not None


def with_speaker(text: str, speaker: int) -> str:
    """MODEL.md §8.2 speaker default: prepend `<|speaker:s|>` unless the text opens with a tag."""
    return text if starts_with_speaker_tag(text) else f"<|speaker:{speaker}|>{text}"


@functools.lru_cache(maxsize=8)
def _unshaped_special(extra_special: frozenset[str]) -> tuple[str, ...]:
    """The tokens of `extra_special` that SPECIAL_TAG does not find (not shaped like `<|name|>`),
    worked out once per token set: a real tokenizer has thousands of special tokens (4124 in the
    full preset's, the semantic ones included), and matching each against SPECIAL_TAG on every
    request took ~1-2.4 ms of the gateway's time before a request reached the backbone."""
    return tuple(sorted(tag for tag in extra_special if not SPECIAL_TAG.fullmatch(tag)))


def validate_text(text: str, param: str, *, allow_blank: bool = False,
                  extra_special: frozenset[str] = frozenset()) -> None:
    """Refuse caller text the prompt must not carry (API.md §2.1).

    Blank text -> `empty_string` (unless allow_blank). Any special token other than a speaker tag
    `<|speaker:0|>`..`<|speaker:15|>` -> `invalid_value`. `extra_special` adds the tokenizer's
    own special tokens to the §8.1 set.
    """
    if not allow_blank and not text.strip():
        raise PromptError("empty_string", param, f"Invalid '{param}': expected a non-empty string.")
    if LONE_SURROGATE.search(text):   # the message must not echo it: it cannot be encoded as UTF-8
        raise PromptError("invalid_value", param, f"Invalid '{param}': the string holds a lone UTF-16 "
                          f"surrogate (U+D800..U+DFFF), which is not a character.")
    for match in SPECIAL_TAG.finditer(text):
        tag = match.group()
        if speaker := SPEAKER_TAG.fullmatch(tag):
            digits = speaker.group(1)
            significant = digits.lstrip("0") or "0"  # int() of thousands of digits would raise
            if len(significant) > 2 or int(significant) >= MAX_SPEAKERS:
                raise PromptError("invalid_value", param, f"Invalid speaker tag '{tag}': speaker "
                                  f"index must be between 0 and {MAX_SPEAKERS - 1}.")
            if digits != significant:
                raise PromptError("invalid_value", param, f"Invalid speaker tag '{tag}': write the "
                                  f"speaker index without leading zeros.")
        elif tag in RESERVED_TOKENS or SEMANTIC_TAG.fullmatch(tag) or tag in extra_special:
            raise PromptError("invalid_value", param, f"Invalid '{param}': the special token "
                              f"'{tag}' is not allowed (it would forge turns or audio rows); only "
                              f"speaker tags <|speaker:0|>..<|speaker:{MAX_SPEAKERS - 1}|> may appear.")
    # Special tokens of a real tokenizer that are not shaped like `<|name|>` (rare).
    for tag in _unshaped_special(extra_special):
        if tag in text:
            raise PromptError("invalid_value", param, f"Invalid '{param}': the special token "
                              f"'{tag}' is not allowed.")


class PromptBuilder:
    """Builds prompts as ids with the checkpoint's tokenizer; one per gateway process."""

    def __init__(self, tokenizer: Tokenizer, config: DramaConfig):
        self.tokenizer = tokenizer
        self.config = config
        self.check_tokenizer()
        added = tokenizer.get_added_tokens_decoder().values()
        self.special_tokens = frozenset(t.content for t in added if t.special) - frozenset(
            f"<|speaker:{i}|>" for i in range(MAX_SPEAKERS))
        self.user_open = self.encode(USER_OPEN)
        self.assistant_open = self.encode(ASSISTANT_OPEN)
        self.turn_close = self.encode(TURN_CLOSE)
        self.system_head = self.encode(SYSTEM_OPEN) + self.encode(SYSTEM_INTRO)
        self.system_speech = self.encode(SYSTEM_SPEECH)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "PromptBuilder":
        checkpoint_dir = Path(checkpoint_dir)
        return cls(Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json")),
                   load_config(checkpoint_dir))

    def check_tokenizer(self) -> None:
        """The special ids of config.json must be the tokenizer's (a mismatched pair of files
        would feed the model wrong rows without any other error)."""
        cfg = self.config
        expected = {"<|im_start|>": cfg.im_start_token_id, "<|im_end|>": cfg.im_end_token_id,
                    "<|pad|>": cfg.pad_token_id, "<|voice|>": cfg.voice_token_id,
                    "<|semantic:0|>": cfg.semantic_start_token_id,
                    f"<|semantic:{cfg.semantic_codebook_size - 1}|>": cfg.semantic_end_token_id}
        expected |= {f"<|speaker:{i}|>": cfg.speaker_start_token_id + i for i in range(cfg.num_speakers)}
        problems = []
        for token, token_id in expected.items():
            found = self.tokenizer.token_to_id(token)
            if found != token_id:
                problems.append(f"{token}: config.json says {token_id}, tokenizer.json has {found}")
            elif self.tokenizer.encode(token, add_special_tokens=False).ids != [token_id]:
                problems.append(f"{token}: not tokenized as its single id {token_id}")
        if self.tokenizer.get_vocab_size() > cfg.text_config.vocab_size:
            problems.append(f"tokenizer has {self.tokenizer.get_vocab_size()} ids, the model "
                            f"{cfg.text_config.vocab_size}")
        if problems:
            raise ValueError("tokenizer.json does not match config.json: " + "; ".join(problems))

    def encode(self, text: str) -> list[int]:
        """One text part's ids, no special tokens added (MODEL.md §8.2)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def validate_text(self, text: str, param: str, *, allow_blank: bool = False) -> None:
        validate_text(text, param, allow_blank=allow_blank, extra_special=self.special_tokens)

    def check_codes(self, codes, param: str) -> torch.Tensor:
        """Codes `[N, T]`, T >= 1, each codebook within its range; returned as int64."""
        cfg = self.config
        codes = torch.as_tensor(codes)
        if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.dim() != 2 \
                or codes.shape[0] != cfg.num_codebooks or codes.shape[1] < 1:
            raise PromptError("invalid_value", param, f"Invalid '{param}': expected integer codes "
                              f"[{cfg.num_codebooks}, T >= 1], got {codes.dtype} {list(codes.shape)}.")
        codes = codes.to(torch.int64)
        limits = [cfg.semantic_codebook_size] + [cfg.residual_codebook_size] * (cfg.num_codebooks - 1)
        for q, limit in enumerate(limits):
            if codes[q].min() < 0 or codes[q].max() >= limit:
                raise PromptError("invalid_value", param, f"Invalid '{param}': codebook {q} values "
                                  f"must be in [0, {limit}).")
        return codes

    def build(self, text: str, *, references: Sequence[RefPart] = (),
              history: Sequence[TakePart] = (), instructions: str | None = None,
              chunk_length: int | None = None, normalize: bool = False,
              text_param: str = "text") -> BuiltPrompt:
        """The prompt of MODEL.md §8.2 for `text`, cut into chunks of `chunk_length` code points
        (default: config `text_chunking.text_chunk_size`). Raises PromptError."""
        chunk_length = chunk_length or self.config.text_chunking.text_chunk_size
        self.validate_text(text, text_param)
        if instructions is not None:
            self.validate_text(instructions, "instructions", allow_blank=True)
        spoken = normalize_text if normalize else (lambda s: s)

        chunk_texts = split_text(with_speaker(spoken(text), 0), chunk_length)
        if not chunk_texts:
            raise PromptError("empty_string", text_param,
                              f"Invalid '{text_param}': it has no text besides speaker tags.")
        if instructions and instructions.strip():
            first = chunk_texts[0]
            tag = SPEAKER_TAG.match(first).group()
            chunk_texts[0] = f"{tag}[{instructions.strip()}] {first[len(tag):]}"
        chunk_ids = [self.encode(chunk) for chunk in chunk_texts]

        system = self._system_turn(references, spoken)
        takes = [self._take_turns(take, i, spoken) for i, take in enumerate(history)]
        audio_frames = sum(s.num_rows for s in system if s.codes is not None) + sum(
            s.num_rows for turns in takes for s in turns if s.codes is not None)
        speakers = sorted({int(m.group(1)) for chunk in chunk_texts
                           for m in SPEAKER_TAG.finditer(chunk)})
        return BuiltPrompt(
            system=system,
            history=takes,
            chunks=[self.user_open + ids + self.turn_close for ids in chunk_ids],
            assistant_open=list(self.assistant_open),
            assistant_close=list(self.turn_close),
            chunk_texts=chunk_texts,
            text_tokens=sum(len(ids) for ids in chunk_ids),
            audio_frames=audio_frames,
            semantic_start_token_id=self.config.semantic_start_token_id,
            num_codebooks=self.config.num_codebooks,
            speakers=speakers,
        )

    def _system_turn(self, references: Sequence[RefPart], spoken) -> list[Segment]:
        """System turn: the transcripts, then all reference codes along time (MODEL.md §8.2)."""
        if not references:
            return []
        # Ordered by speaker, then as given (sorted is stable); errors name the caller's index.
        ordered = sorted(enumerate(references), key=lambda item: item[1].speaker)
        tokens = list(self.system_head)
        codes = []
        for index, ref in ordered:
            self._check_speaker(ref.speaker, f"references[{index}].speaker")
            self.validate_text(ref.text, f"references[{index}].text", allow_blank=True)
            codes.append(self.check_codes(ref.codes, f"references[{index}].vq_codes"))
            if ref.text.strip():  # an empty transcript adds no text part and no speaker tag
                tokens += self.encode(with_speaker(spoken(ref.text), ref.speaker))
        tokens += self.system_speech
        return [Segment(tokens=tokens), Segment(codes=torch.cat(codes, dim=1)),
                Segment(tokens=list(self.turn_close))]

    def _take_turns(self, take: TakePart, index: int, spoken) -> list[Segment]:
        """A previous take: its user turn, then the assistant turn holding its codes."""
        self._check_speaker(take.speaker, f"history[{index}].speaker")
        self.validate_text(take.text, f"history[{index}].text", allow_blank=True)
        codes = self.check_codes(take.codes, f"history[{index}].vq_codes")
        text_ids = self.encode(with_speaker(spoken(take.text), take.speaker)) if take.text.strip() else []
        return [Segment(tokens=self.user_open + text_ids + self.turn_close + self.assistant_open),
                Segment(codes=codes),
                Segment(tokens=list(self.turn_close))]

    def _check_speaker(self, speaker: int, param: str) -> None:
        if not isinstance(speaker, int) or not 0 <= speaker < MAX_SPEAKERS:
            raise PromptError("out_of_range", param, f"Invalid '{param}': expected a value between "
                              f"0 and {MAX_SPEAKERS - 1}, but got {speaker} instead.")
