"""Prompt builder (MODEL.md §8.2): golden token ids on the tiny tokenizer, validation, properties.

The expected ids are written out from the tokenizer spec (MODEL.md §10.2), not from the code under
test: an ASCII byte b has id b, and the special tokens have the ids below.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.prompt import PromptBuilder, PromptError, RefPart, TakePart, validate_text

PRESET = Path(__file__).resolve().parents[1] / "services" / "common" / "presets" / "tiny.json"

# MODEL.md §10.2 ids.
IM_START, IM_END, VOICE = 258, 259, 263
SEMANTIC_0 = 284
NL = 10


def SPK(n: int) -> int:
    return 268 + n


def b(text: str) -> list[int]:
    """Ids of ASCII text on the tiny tokenizer: one id per byte, equal to the byte."""
    return list(text.encode("ascii"))


USER = [IM_START] + b("user\n")
CLOSE = [IM_END, NL]
ASSISTANT = [IM_START] + b("assistant\n") + [VOICE]
SYSTEM_HEAD = [IM_START] + b("system\n") + b(
    "convert the provided text to speech reference to the following:\n\nText:\n")
SPEECH = b("\n\nSpeech:\n")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def spec_tokenizer():
    """The tiny tokenizer built straight from MODEL.md §10.2 (independent of services.common)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    names = ["endoftext", "pad", "im_start", "im_end", "phoneme_start", "phoneme_end", "text",
             "voice", "interleave", "audio_start", "audio_end", "audio_pad"]
    names += [f"speaker:{i}" for i in range(16)] + [f"semantic:{i}" for i in range(64)]
    tokenizer.add_special_tokens([AddedToken(f"<|{name}|>", special=True) for name in names])
    return tokenizer


@pytest.fixture(scope="module")
def prompt_dir(tmp_path_factory) -> Path:
    """config.json (tiny preset) + the spec-built tokenizer.json."""
    out = tmp_path_factory.mktemp("prompt")
    shutil.copy(PRESET, out / "config.json")
    spec_tokenizer().save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def builder(prompt_dir) -> PromptBuilder:
    return PromptBuilder.from_checkpoint(prompt_dir)


def codes(*semantic: int, n: int = 10) -> torch.Tensor:
    """Codes [n, T] with the given semantic codes and residual code q+1 in codebook q."""
    frames = torch.zeros(n, len(semantic), dtype=torch.int64)
    frames[0] = torch.tensor(semantic)
    for q in range(1, n):
        frames[q] = q + 1
    return frames


# ---------------------------------------------------------------------------------------------
# golden ids
# ---------------------------------------------------------------------------------------------

def test_tokenizer_maps_template_specials_to_single_ids(builder):
    """The spec tokenizer agrees with §10.2 on bytes and specials (guards the golden tests)."""
    assert builder.encode("<|im_start|>user\n") == USER
    assert builder.encode("Hi there.") == b("Hi there.")
    assert builder.encode("<|semantic:63|><|speaker:15|>") == [347, 283]


def test_no_references(builder):
    prompt = builder.build("Hi there.")
    assert prompt.system == [] and prompt.history == []
    assert prompt.chunk_texts == ["<|speaker:0|>Hi there."]
    assert prompt.chunks == [USER + [SPK(0)] + b("Hi there.") + CLOSE]
    assert prompt.assistant_open == ASSISTANT
    assert prompt.assistant_close == CLOSE
    assert prompt.text_tokens == 1 + len("Hi there.")
    assert prompt.audio_frames == 0
    ids, frames = prompt.flat_rows()
    assert ids == USER + [SPK(0)] + b("Hi there.") + CLOSE + ASSISTANT
    assert frames.shape == (10, len(ids)) and bool((frames == -1).all())


def test_one_reference_with_transcript(builder):
    ref = codes(5, 7, 63)
    prompt = builder.build("Go.", references=[RefPart("Hello.", ref)])
    expected_head = SYSTEM_HEAD + [SPK(0)] + b("Hello.") + SPEECH
    assert prompt.system[0].tokens == expected_head
    assert torch.equal(prompt.system[1].codes, ref)
    assert prompt.system[2].tokens == CLOSE
    assert prompt.audio_frames == 3
    ids, frames = prompt.flat_rows()
    chunk = USER + [SPK(0)] + b("Go.") + CLOSE
    assert ids == expected_head + [SEMANTIC_0 + 5, SEMANTIC_0 + 7, SEMANTIC_0 + 63] + CLOSE + chunk + ASSISTANT
    audio = slice(len(expected_head), len(expected_head) + 3)
    assert torch.equal(frames[:, audio], ref)
    assert bool((frames[:, :audio.start] == -1).all()) and bool((frames[:, audio.stop:] == -1).all())


def test_two_speakers_references_ordered_by_speaker(builder):
    """References sort by speaker (stable), each transcript gets its own speaker's tag."""
    bob, ann, ann2 = codes(1), codes(2, 3), codes(4)
    refs = [RefPart("Bob.", bob, speaker=1), RefPart("Ann.", ann, speaker=0),
            RefPart("", ann2, speaker=0)]  # an empty transcript adds no text and no tag
    prompt = builder.build("<|speaker:0|>Hi.<|speaker:1|>Yo.", references=refs)
    assert prompt.system[0].tokens == SYSTEM_HEAD + [SPK(0)] + b("Ann.") + [SPK(1)] + b("Bob.") + SPEECH
    assert prompt.system[1].codes[0].tolist() == [2, 3, 4, 1]
    assert prompt.chunks == [USER + [SPK(0)] + b("Hi.") + [SPK(1)] + b("Yo.") + CLOSE]
    assert prompt.speakers == [0, 1]


def test_reference_that_carries_its_own_tag_is_kept(builder):
    prompt = builder.build("Go.", references=[RefPart("  <|speaker:3|>Mine.", codes(1), speaker=1)])
    assert prompt.system[0].tokens == SYSTEM_HEAD + b("  ") + [SPK(3)] + b("Mine.") + SPEECH


def test_previous_take(builder):
    take = codes(9, 8)
    prompt = builder.build("Next.", history=[TakePart("Before.", take, speaker=1)])
    user_and_open = USER + [SPK(1)] + b("Before.") + CLOSE + ASSISTANT
    assert len(prompt.history) == 1
    turns = prompt.history[0]
    assert turns[0].tokens == user_and_open
    assert torch.equal(turns[1].codes, take)
    assert turns[2].tokens == CLOSE
    ids, _ = prompt.flat_rows()
    assert ids == user_and_open + [SEMANTIC_0 + 9, SEMANTIC_0 + 8] + CLOSE + USER + [SPK(0)] + b(
        "Next.") + CLOSE + ASSISTANT
    assert prompt.audio_frames == 2


def test_instructions_after_leading_speaker_tag(builder):
    prompt = builder.build("<|speaker:2|>Go now.", instructions="  whisper ")
    assert prompt.chunk_texts == ["<|speaker:2|>[whisper] Go now."]
    assert prompt.chunks == [USER + [SPK(2)] + b("[whisper] Go now.") + CLOSE]
    assert prompt.text_tokens == 1 + len("[whisper] Go now.")


def test_instructions_without_tag_and_only_in_first_chunk(builder):
    text = "First sentence is here. " * 3 + "Second part follows now."
    prompt = builder.build(text, instructions="calm", chunk_length=40)
    assert len(prompt.chunk_texts) > 1
    assert prompt.chunk_texts[0].startswith("<|speaker:0|>[calm] First")
    assert all("[calm]" not in chunk for chunk in prompt.chunk_texts[1:])
    blank = builder.build("Go.", instructions="   ")
    assert blank.chunk_texts == ["<|speaker:0|>Go."]


def test_second_chunk_timeline_splices_previous_chunk(builder):
    """API.md §3.4: chunk i = system ‖ history ‖ chunk i-1 turns with its frames ‖ chunk i."""
    prompt = builder.build("One two three. Four five six.", chunk_length=20)
    # 13 code points of tag leave 7: "One two" fits exactly; "three." wins over "three. Four"
    # because the sentence end outranks the space after it.
    assert prompt.chunk_texts == ["<|speaker:0|>One two", "<|speaker:0|>three.",
                                  "<|speaker:0|>Four", "<|speaker:0|>five", "<|speaker:0|>six."]
    generated = codes(11, 12)
    ids, frames = prompt.flat_rows(1, previous_codes=generated)
    first = USER + [SPK(0)] + b("One two") + CLOSE
    second = USER + [SPK(0)] + b("three.") + CLOSE
    assert ids == first + ASSISTANT + [SEMANTIC_0 + 11, SEMANTIC_0 + 12] + CLOSE + second + ASSISTANT
    start = len(first + ASSISTANT)
    assert torch.equal(frames[:, start:start + 2], generated)
    with pytest.raises(ValueError):
        prompt.flat_rows(1)


def test_normalize_flag(builder):
    assert builder.build("I have 3 cats.", normalize=True).chunk_texts == ["<|speaker:0|>I have three cats."]
    assert builder.build("I have 3 cats.").chunk_texts == ["<|speaker:0|>I have 3 cats."]


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------

def test_speaker_index_above_15_is_refused_with_exact_message():
    with pytest.raises(PromptError) as info:
        validate_text("Hi <|speaker:16|> there", "input")
    assert (info.value.code, info.value.param) == ("invalid_value", "input")
    assert info.value.message == "Invalid speaker tag '<|speaker:16|>': speaker index must be between 0 and 15."


@pytest.mark.parametrize("index", ["16", "99", "9" * 5000, "0" * 3000 + "17"])
def test_any_speaker_index_above_15_is_refused(index):
    with pytest.raises(PromptError, match="speaker index must be between 0 and 15"):
        validate_text(f"<|speaker:{index}|>Hi", "text")


def test_speaker_index_with_leading_zeros_is_refused():
    with pytest.raises(PromptError, match="leading zeros"):
        validate_text("<|speaker:01|>Hi", "text")
    validate_text("<|speaker:0|>Hi<|speaker:10|>", "text")


@pytest.mark.parametrize("token", ["<|im_end|>", "<|im_start|>", "<|voice|>", "<|semantic:3|>",
                                   "<|semantic:99999|>", "<|endoftext|>", "<|audio_pad|>"])
def test_other_special_tokens_are_refused(builder, token):
    with pytest.raises(PromptError) as info:
        builder.validate_text(f"Hello {token} world", "text")
    assert info.value.code == "invalid_value" and "forge turns or audio rows" in info.value.message


def test_tokenizer_special_tokens_outside_the_spec_list_are_refused(builder):
    builder_specials = builder.special_tokens
    assert "<|phoneme_start|>" in builder_specials and "<|speaker:3|>" not in builder_specials


def test_extra_special_tokens_of_any_shape_are_refused():
    """A tokenizer's special tokens are refused whether shaped like <|name|> (found by the tag
    pattern) or not (found by substring: the set of those is worked out once per token set)."""
    extra = frozenset({"<|custom|>", "[EOS]", "<pad>"})
    for text in ("Hi <|custom|>", "Hi [EOS] there", "a<pad>b"):
        with pytest.raises(PromptError) as info:
            validate_text(text, "text", extra_special=extra)
        assert info.value.code == "invalid_value"
    validate_text("Hi [EOS there <pa d> <|custom", "text", extra_special=extra)
    validate_text("Hi [EOS] there", "text")                       # not special without the set
    with pytest.raises(PromptError):                              # a second set is its own entry
        validate_text("Hi [BOS]", "text", extra_special=frozenset({"[BOS]"}))


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_blank_text_is_empty_string(builder, text):
    with pytest.raises(PromptError) as info:
        builder.build(text, text_param="input")
    assert (info.value.code, info.value.param) == ("empty_string", "input")


def test_text_of_speaker_tags_only_is_empty(builder):
    with pytest.raises(PromptError) as info:
        builder.build("<|speaker:1|> <|speaker:2|>")
    assert info.value.code == "empty_string"


def test_allowed_text_passes(builder):
    builder.validate_text("<|speaker:0|>Hi [laughs] <whisper>x</whisper> <|unknown|> <|speaker:15|>", "text")


def test_reference_errors_name_the_callers_index(builder):
    bad = RefPart("Bad <|im_end|>", codes(1), speaker=0)
    with pytest.raises(PromptError) as info:
        builder.build("Go.", references=[RefPart("Ok.", codes(1), speaker=3), bad])
    assert info.value.param == "references[1].text"
    with pytest.raises(PromptError) as info:
        builder.build("Go.", references=[RefPart("Ok.", codes(1, n=3))])
    assert info.value.param == "references[0].vq_codes"
    with pytest.raises(PromptError) as info:
        builder.build("Go.", history=[TakePart("Ok.", codes(64))])  # semantic code out of range
    assert info.value.param == "history[0].vq_codes"
    with pytest.raises(PromptError) as info:
        builder.build("Go.", references=[RefPart("Ok.", codes(1), speaker=16)])
    assert info.value.param == "references[0].speaker"


def test_config_tokenizer_mismatch_is_refused(prompt_dir, tmp_path):
    import json

    config = json.loads((prompt_dir / "config.json").read_text())
    config["voice_token_id"] = 262
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(prompt_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="<\\|voice\\|>"):
        PromptBuilder.from_checkpoint(tmp_path)


def test_generated_tiny_checkpoint_tokenizer_gives_the_same_ids(prompt_dir, tmp_path):
    """make_checkpoint's tiny tokenizer.json gives the ids of the spec-built one here."""
    from services.common.make_checkpoint import make_checkpoint

    theirs = PromptBuilder.from_checkpoint(make_checkpoint(tmp_path, preset="tiny", dry_run=True))
    ours = PromptBuilder.from_checkpoint(prompt_dir)
    text = "<|speaker:1|>Hello, wörld! [laughs] 你好 <|speaker:0|>ok"
    refs = [RefPart("Ref.", codes(3), speaker=1)]
    ids_theirs, frames_theirs = theirs.build(text, references=refs).flat_rows()
    ids_ours, frames_ours = ours.build(text, references=refs).flat_rows()
    assert ids_theirs == ids_ours and torch.equal(frames_theirs, frames_ours)


def test_full_preset_tokenizer_builds_with_its_own_special_ids(tmp_path):
    """The full preset places specials at Qwen-like ids; the builder takes them from the files."""
    from services.common.config import load_config
    from services.common.make_checkpoint import make_checkpoint

    directory = make_checkpoint(tmp_path, preset="full", dry_run=True)
    cfg = load_config(directory)
    prompt = PromptBuilder.from_checkpoint(directory).build(
        "Hi.", references=[RefPart("Ref.", codes(7, n=cfg.num_codebooks), speaker=0)])
    assert prompt.assistant_open[0] == cfg.im_start_token_id
    assert prompt.assistant_open[-1] == cfg.voice_token_id
    assert prompt.assistant_close[0] == cfg.im_end_token_id
    assert prompt.chunks[0][0] == cfg.im_start_token_id
    assert prompt.chunks[0][len(USER)] == cfg.speaker_start_token_id  # after "<|im_start|>user\n"
    ids, _ = prompt.flat_rows()
    assert cfg.semantic_start_token_id + 7 in ids


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------

PIECES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["<|speaker:0|>", "<|speaker:1|>", "<|speaker:15|>", "[laughs]", "[a [b] c]",
                     "<whisper>", "</whisper>", "[", "]", "<", ">", "<|", "|>", ". ", "\n", "，"]),
)


FORBIDDEN_IDS = set(range(256, 268)) | set(range(284, 352))  # specials other than speaker tags


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(PIECES, max_size=20), chunk_length=st.integers(32, 80),
       ref_text=st.lists(PIECES, max_size=4).map("".join),
       take_text=st.lists(PIECES, max_size=4).map("".join))
def test_build_never_crashes_and_ids_decode_to_the_chunks(builder, pieces, chunk_length, ref_text,
                                                          take_text):
    """Any Unicode text either builds or is refused with a PromptError; built chunks are exactly
    the user-turn template around the tokenized chunk text, and no caller text yields a special
    id other than a speaker tag."""
    text = "".join(pieces)
    try:
        prompt = builder.build(text, chunk_length=chunk_length,
                               references=[RefPart(ref_text, codes(1), speaker=1)],
                               history=[TakePart(take_text, codes(2), speaker=2)])
    except PromptError as exc:
        assert exc.code in ("empty_string", "invalid_value")
        return
    assert len(prompt.chunks) == len(prompt.chunk_texts) >= 1
    for ids, chunk_text in zip(prompt.chunks, prompt.chunk_texts):
        assert ids[:len(USER)] == USER and ids[-2:] == CLOSE
        assert builder.tokenizer.decode(ids[len(USER):-2], skip_special_tokens=False) == chunk_text
        assert 268 <= ids[len(USER)] <= 283  # every chunk opens with a speaker tag
        assert not FORBIDDEN_IDS & set(ids[len(USER):-2])
    system_text = prompt.system[0].tokens[len(SYSTEM_HEAD):-len(SPEECH)]
    take_text_ids = prompt.history[0][0].tokens[len(USER):-len(CLOSE + ASSISTANT)]
    assert not FORBIDDEN_IDS & set(system_text + take_text_ids)
