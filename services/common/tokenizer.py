"""The generated checkpoints' tokenizer.json (MODEL.md §10.2) and the config/tokenizer id check (§2.2).

The tiny tokenizer is a byte-level BPE whose vocabulary is exactly the 256 ByteLevel symbols (the
symbol of byte b has id b) with no merges, so any text encodes to its UTF-8 bytes and decodes
back. The special tokens of §8.1 follow as added tokens. Ids past the last token up to
`vocab_size` are embedding padding rows, not tokens.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from services.common.config import ConfigError, DramaConfig

# §8.1, in the order the tiny tokenizer assigns ids from 256.
FIXED_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|phoneme_start|>",
    "<|phoneme_end|>", "<|text|>", "<|voice|>", "<|interleave|>", "<|audio_start|>",
    "<|audio_end|>", "<|audio_pad|>",
)


def speaker_token(i: int) -> str:
    return f"<|speaker:{i}|>"


def semantic_token(i: int) -> str:
    return f"<|semantic:{i}|>"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (the ByteLevel pre-tokenizer's alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:   # unprintable bytes map to code points from 256 up, in byte order
            table[b] = chr(256 + extra)
            extra += 1
    return table


def special_tokens(cfg: DramaConfig) -> list[str]:
    """All §8.1 tokens of `cfg`: the fixed ones, the speaker tags, the semantic tokens."""
    return (list(FIXED_SPECIAL_TOKENS) + [speaker_token(i) for i in range(cfg.num_speakers)]
            + [semantic_token(i) for i in range(cfg.semantic_codebook_size)])


def build_byte_level_tokenizer(special_ids: dict[str, int]) -> Tokenizer:
    """Byte-level BPE over the 256 ByteLevel symbols plus `special_ids` as added special tokens.

    With ids consecutive from 256 (the tiny tokenizer) the specials exist only as added tokens,
    exactly as §10.2 describes. tokenizers numbers added tokens consecutively after the model
    vocabulary, so other ids (the full preset puts its tokens where a Qwen3.5 vocabulary would,
    with gaps) are made by also entering the specials in the BPE vocabulary at those ids; an added
    token that the model already knows keeps the model's id.
    """
    vocab = {symbol: b for b, symbol in bytes_to_unicode().items()}
    consecutive = sorted(special_ids.values()) == list(range(256, 256 + len(special_ids)))
    if not consecutive:
        vocab.update(special_ids)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    ordered = sorted(special_ids, key=special_ids.get)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ordered])
    wrong = [t for t, i in special_ids.items() if tok.token_to_id(t) != i]
    if wrong:
        raise ValueError(f"tokenizers did not keep the requested ids of {wrong[:5]}")
    return tok


def tiny_special_ids(cfg: DramaConfig) -> dict[str, int]:
    """§10.2: the special tokens in order from id 256."""
    return {t: 256 + i for i, t in enumerate(special_tokens(cfg))}


def build_tiny_tokenizer(cfg: DramaConfig) -> Tokenizer:
    """The §10.2 tokenizer for `cfg` (ids must agree with cfg's; check_token_ids verifies)."""
    return build_byte_level_tokenizer(tiny_special_ids(cfg))


def config_token_ids(cfg: DramaConfig) -> dict[str, int]:
    """token -> the id config.json gives it (§2.2)."""
    ids = {
        "<|im_start|>": cfg.im_start_token_id, "<|im_end|>": cfg.im_end_token_id,
        "<|pad|>": cfg.pad_token_id, "<|voice|>": cfg.voice_token_id,
    }
    ids.update({speaker_token(i): cfg.speaker_start_token_id + i for i in range(cfg.num_speakers)})
    ids.update({semantic_token(i): cfg.semantic_start_token_id + i
                for i in range(cfg.semantic_codebook_size)})
    return ids


def check_token_ids(cfg: DramaConfig, tokenizer: Tokenizer) -> None:
    """Raise ConfigError if any id in the config disagrees with tokenizer.json (MODEL.md §2.2).

    Covers the named ids and every speaker and semantic token they imply (the semantic range must
    be contiguous in the tokenizer too).
    """
    problems = []
    for token, want in config_token_ids(cfg).items():
        got = tokenizer.token_to_id(token)
        if got != want:
            problems.append(f"{token}: config says {want}, tokenizer.json says "
                            f"{'nothing (not a token)' if got is None else got}")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ConfigError(f"token ids disagree with tokenizer.json: {shown}")


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found")
    return Tokenizer.from_file(str(path))
