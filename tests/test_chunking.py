"""Tag-aware chunking (MODEL.md §8.3) and text normalization (API.md §2.1 `normalize`)."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chunking import atomize, split_text
from gateway.normalize import normalize_text, number_to_words, ordinal_words

S0, S1 = "<|speaker:0|>", "<|speaker:1|>"

# Independent restatements of the tag shapes of §8.3, for the property checks.
SPEAKER = re.compile(r"<\|speaker:\d+\|>")
SPECIAL = re.compile(r"<\|[^<>|\s]*\|>")
SIMPLE_DIRECTION = re.compile(r"\[[^\[\]\n]*\]")
WORD_TAG = re.compile(r"</?\w[\w.-]*>")


# ---------------------------------------------------------------------------------------------
# atoms and cut preference
# ---------------------------------------------------------------------------------------------

def test_atoms():
    text = "Hi [a [b] c]<|speaker:1|><w>x</w> a<b [open\n"
    assert [(a.text, a.kind) for a in atomize(text)] == [
        ("Hi", "word"), (" ", "space"), ("[a [b] c]", "direction"), ("<|speaker:1|>", "speaker"),
        ("<w>", "open"), ("x", "word"), ("</w>", "close"), (" ", "space"), ("a<b", "word"),
        (" ", "space"), ("[open", "word"), ("\n", "space")]


def test_direction_does_not_swallow_a_special_tag():
    assert [a.text for a in atomize("[x<|speaker:1|>y]")] == ["[x", "<|speaker:1|>", "y]"]


def test_short_text_is_one_chunk():
    assert split_text("  Hello there.  ", 128) == ["Hello there."]
    assert split_text("", 128) == [] and split_text(" \n ", 128) == []


def test_sentence_end_beats_later_whitespace():
    # "aaa bbb. ccc ddd" + "eee" passes 18: the cut after "bbb." outranks the later spaces.
    assert split_text("aaa bbb. ccc ddd eee", 18) == ["aaa bbb.", "ccc ddd eee"]


def test_clause_beats_whitespace_and_sentence_beats_clause():
    assert split_text("aaa, bbb ccc ddd", 14) == ["aaa,", "bbb ccc ddd"]
    assert split_text("aa. bb, cc dd", 12) == ["aa.", "bb, cc dd"]


def test_latest_among_equal_boundaries():
    assert split_text("a b c d e f", 7) == ["a b c d", "e f"]


def test_speaker_tag_is_the_best_cut_and_is_kept_in_each_chunk():
    text = f"{S0}One. Two.{S1}Three four five."
    assert split_text(text, 40) == [f"{S0}One. Two.", f"{S1}Three four five."]


def test_speaker_in_force_is_prepended_after_a_cut():
    text = f"{S1}Alpha beta. Gamma delta."
    assert split_text(text, 28) == [f"{S1}Alpha beta.", f"{S1}Gamma delta."]


def test_text_before_the_first_tag_is_speaker_zero():
    assert split_text(f"Hello. {S1}Bye.", 128) == [f"{S0}Hello. {S1}Bye."]
    assert split_text(f"Hello. {S1}Bye.", 16) == [f"{S0}Hello.", f"{S1}Bye."]


def test_no_tags_no_prefix():
    assert split_text("one two three four", 9) == ["one two", "three", "four"]


def test_newline_is_a_sentence_boundary():
    assert split_text("aaa\nbbb ccc ddd", 12) == ["aaa", "bbb ccc ddd"]


def test_cut_inside_word_tag_pair_ranks_below_all():
    # Without the pair rule the sentence end after "b." would win; inside <w>…</w> it loses to
    # the plain space before <w>.
    text = "aa <w>b. cc</w> dd"
    assert split_text(text, 14) == ["aa", "<w>b. cc</w>", "dd"]


def test_unmatched_word_tag_does_not_demote_cuts():
    assert split_text("aa <w>b. cc dd", 10) == ["aa <w>b.", "cc dd"]


def test_atom_longer_than_the_limit_is_its_own_chunk():
    long_word = "x" * 50
    assert split_text(f"ab {long_word} cd", 10) == ["ab", long_word, "cd"]
    direction = "[" + "y " * 20 + "]"
    assert split_text(f"ab {direction} cd", 10) == ["ab", direction, "cd"]


def test_cjk_cuts_after_full_width_punctuation():
    text = "你好世界。今天天气很好，我们出去走走吧。"
    # The sentence end after 。 beats the clause mark ， that is later in the first 12 characters.
    assert split_text(text, 12) == ["你好世界。", "今天天气很好，", "我们出去走走吧。"]


def test_chunk_of_speaker_tags_only_is_dropped():
    assert split_text(f"{S1}{S0}Hi.", 13) == [f"{S0}Hi."]


@pytest.mark.parametrize("text", ["[" * 32768, "[a" * 16384, "<w>" * 10000 + "</w>" * 1000,
                                  "<|" * 16384, "1" * 32768, "1," * 16384])
def test_hostile_inputs_of_the_maximum_length_stay_fast(text):
    """32768 code points is the /v1/tts limit; nothing may go quadratic (or past int()'s limit)."""
    started = time.monotonic()
    assert split_text(text, 128)
    assert normalize_text(text)
    assert time.monotonic() - started < 5


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError):
        split_text("x", 0)


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------

PIECES = st.one_of(
    st.text(max_size=10),
    st.text(alphabet="ab .,!\n", max_size=10),
    st.sampled_from([S0, S1, "<|speaker:12|>", "<|im_end|>", "[laughs]", "[a [b] c]",
                     "[nervous, barely holding it together]", "<whisper>", "</whisper>", "<w>",
                     "</w>", "[", "]", "<", ">", "<|", "|>", "。", "，", "…", " ", "\n",
                     "supercalifragilisticexpialidocious"]),
)


def nonspace(text: str) -> str:
    return "".join(text.split())


def locate(text: str, chunks: list[str]) -> list[tuple[int, int, bool]]:
    """Each chunk's span in `text` and whether its leading speaker tag was prepended. Checks that
    the chunks are contiguous pieces of the text in order, with only whitespace and speaker tags
    between them."""
    spans, cursor = [], 0
    speaker_spans = [m.span() for m in SPEAKER.finditer(text)]

    def inside_tag(pos: int) -> bool:  # e.g. "<" matching the start of "<|speaker:0|>"
        return any(s < pos < e for s, e in speaker_spans)

    for chunk in chunks:
        options = [(chunk, False)]
        if tag := SPEAKER.match(chunk):
            options.append((chunk[tag.end():], True))
        for body, prepended in options:
            # The first occurrence with only whitespace and speaker tags before it (an earlier
            # one may sit inside a tag: "0" in "<|speaker:0|>").
            pos = text.find(body, cursor)
            while pos >= 0 and (SPEAKER.sub("", text[cursor:pos]).strip()
                                or inside_tag(pos + len(body))):
                pos = text.find(body, pos + 1)
            if pos >= 0:
                spans.append((pos, pos + len(body), prepended))
                cursor = pos + len(body)
                break
        else:
            raise AssertionError(f"chunk {chunk!r} is not the next piece of the text")
    assert not SPEAKER.sub("", text[cursor:]).strip()
    return spans


def tag_spans(text: str) -> list[tuple[int, int]]:
    specials = [m.span() for m in SPECIAL.finditer(text)]
    directions = [m.span() for m in SIMPLE_DIRECTION.finditer(text)
                  if not any(s < m.end() and m.start() < e for s, e in specials)]
    return specials + directions + [m.span() for m in WORD_TAG.finditer(text)]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=25), chunk_size=st.integers(1, 60))
def test_chunking_properties(pieces, chunk_size):
    text = "".join(pieces)
    chunks = split_text(text, chunk_size)
    has_speaker = SPEAKER.search(text) is not None

    # All non-whitespace content survives, in order (speaker tags aside: they are repeated).
    assert nonspace(SPEAKER.sub("", text)) == "".join(nonspace(SPEAKER.sub("", c)) for c in chunks)
    for chunk in chunks:
        assert chunk == chunk.strip() and chunk
        if has_speaker:
            assert SPEAKER.match(chunk), chunk
        if len(chunk) > chunk_size:  # only a single atom (after its speaker tag) may pass the limit
            body = chunk[SPEAKER.match(chunk).end():] if has_speaker else chunk
            assert len(atomize(body)) == 1, (chunk, chunk_size)

    spans = locate(text, chunks)
    cuts = {pos for start, end, _ in spans for pos in (start, end)}
    for start, end in tag_spans(text):
        assert not any(start < cut < end for cut in cuts), (text[start:end], chunks)

    # A prepended tag is the speaker in force there (speaker 0 before the first tag).
    for (start, _, prepended), chunk in zip(spans, chunks):
        if prepended:
            in_force = [m.group() for m in SPEAKER.finditer(text[:start])]
            assert SPEAKER.match(chunk).group() == (in_force[-1] if in_force else S0)


# ---------------------------------------------------------------------------------------------
# normalize
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, words", [
    (0, "zero"), (7, "seven"), (13, "thirteen"), (40, "forty"), (42, "forty-two"),
    (100, "one hundred"), (305, "three hundred five"), (1000, "one thousand"),
    (1234567, "one million two hundred thirty-four thousand five hundred sixty-seven"),
    (-3, "minus three")])
def test_number_to_words(n, words):
    assert number_to_words(n) == words


@pytest.mark.parametrize("n, words", [(1, "first"), (2, "second"), (3, "third"), (12, "twelfth"),
                                      (20, "twentieth"), (21, "twenty-first"), (100, "one hundredth")])
def test_ordinals(n, words):
    assert ordinal_words(n) == words


@pytest.mark.parametrize("text, expected", [
    ("I have 3 cats.", "I have three cats."),
    ("It costs $5.50 now", "It costs five dollars and fifty cents now"),
    ("£1 and €2", "one pound and two euros"),
    ("Population 1,234,567!", "Population one million two hundred thirty-four thousand five hundred sixty-seven!"),
    ("Pi is 3.14", "Pi is three point one four"),
    ("Born in 1990, moved in 2008.", "Born in nineteen ninety, moved in two thousand eight."),
    ("the 1990s and the 80s", "the nineteen nineties and the eighties"),
    ("On 2024-03-15 at 10:30 pm.", "On March fifteenth, twenty twenty-four at ten thirty p m."),
    ("at 9:05 or 7:00", "at nine oh five or seven o'clock"),
    ("the 21st time", "the twenty-first time"),
    ("5 km and 1 kg and 50% and 2.5 m", "five kilometers and one kilogram and fifty percent and two point five meters"),
    ("It was -5 outside", "It was minus five outside"),
    ("an mp3 file", "an mp three file"),
    ("code 007", "code zero zero seven"),
    ("3cats at 1.5x", "three cats at one point five x"),
])
def test_normalize_examples(text, expected):
    assert normalize_text(text) == expected


def test_normalize_leaves_tags_alone():
    text = "<|speaker:1|>I ran 5 km [sighs 3 times] <w2>then 2 more</w2> [a [b 4] c]"
    assert normalize_text(text) == (
        "<|speaker:1|>I ran five kilometers [sighs 3 times] <w2>then two more</w2> [a [b 4] c]")


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("0123456789 .,:-$%/abskmg<>[]|\n°C")) | st.characters(),
                    max_size=40))
def test_normalize_is_idempotent_and_keeps_tags(text):
    once = normalize_text(text)
    assert normalize_text(once) == once
    tags = [a.text for a in atomize(text) if a.kind not in ("word", "space")]
    assert [a.text for a in atomize(once) if a.kind not in ("word", "space")] == tags
