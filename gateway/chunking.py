"""Tag-aware long-form chunking (MODEL.md §8.3).

Pure functions, no tokenizer: a text is cut into chunks of at most `chunk_size` Unicode code
points, only between atoms, preferring the best boundary, and every chunk is attributed to the
speaker in force at its start.

Atoms, in the order they are recognised at a position:
    special tag      `<|speaker:1|>`, `<|im_end|>`       (any `<|name|>` without blanks or <>|)
    direction        `[laughs]`, `[nervous, [quietly]]`  (balanced brackets, on one line, no special tag inside)
    word tag         `<whisper>`, `</whisper>`
    whitespace run
    word             everything else; a CJK character or full-width punctuation mark is a word of
                     its own, since CJK text has no spaces to cut at

Boundary ranks (higher is better; the cut before atom k sits between atoms k-1 and k):
    4 before a speaker tag
    3 after sentence-final punctuation or at a newline
    2 after clause punctuation
    1 at whitespace
    0 any other boundary between atoms (e.g. between a word and a direction)
A boundary inside a matched `<name>…</name>` pair drops below all of these (rank - 5), keeping
the order among such boundaries.

Choices the spec leaves open (ours):
- Length counts every code point of the chunk as emitted, including a prepended speaker tag, so
  every chunk is within `chunk_size` unless it holds a single atom that does not fit with its tag.
- Text before the first speaker tag is speaker 0 (API.md §2.1), so when a text has any speaker tag,
  untagged chunks before the first one get `<|speaker:0|>`. A text without speaker tags gets none.
- A chunk with nothing but speaker tags and whitespace is dropped (it has nothing to say).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SPECIAL_TAG = re.compile(r"<\|[^<>|\s]*\|>")
SPEAKER_TAG = re.compile(r"<\|speaker:(\d+)\|>")
WORD_TAG = re.compile(r"<(/?)(\w[\w.-]*)>")
WHITESPACE = re.compile(r"\s+")

SENTENCE_END = frozenset(".!?…。！？")
CLAUSE_END = frozenset(",;:，、；：")
# Closing quotes and brackets may follow the punctuation that ends a sentence: `"Go."` ends one.
CLOSERS = "\"'”’)»」』）"

RANK_SPEAKER, RANK_SENTENCE, RANK_CLAUSE, RANK_SPACE, RANK_OTHER = 4, 3, 2, 1, 0
INSIDE_WORD_TAG_PENALTY = 5


@dataclass(frozen=True)
class Atom:
    text: str
    kind: str          # "speaker", "special", "direction", "open", "close", "space", "word"
    start: int         # code-point offset in the original text
    name: str = ""     # word-tag name for "open"/"close"

    @property
    def end(self) -> int:
        return self.start + len(self.text)


def is_cjk(char: str) -> bool:
    """CJK ideographs, kana, and full-width punctuation: each is a word atom of its own."""
    code = ord(char)
    return (0x3000 <= code <= 0x30FF or 0x3400 <= code <= 0x4DBF or 0x4E00 <= code <= 0x9FFF
            or 0xF900 <= code <= 0xFAFF or 0xFF00 <= code <= 0xFFEF or 0x20000 <= code <= 0x2FA1F)


def direction_ends(text: str) -> dict[int, int]:
    """For each `[` that opens a bracketed direction, the offset just past its matching `]`.

    Brackets match like parentheses, but only on one line and never across a special tag (the
    special tag is the stronger atom): a newline or a special tag leaves every open `[` unmatched.
    One pass, so a hostile text of 32k `[` costs no more than any other.
    """
    ends: dict[int, int] = {}
    open_stack: list[int] = []
    pos = 0
    while pos < len(text):
        char = text[pos]
        if char == "\n":
            open_stack.clear()
        elif char == "<" and (tag := SPECIAL_TAG.match(text, pos)):
            open_stack.clear()
            pos = tag.end()
            continue
        elif char == "[":
            open_stack.append(pos)
        elif char == "]" and open_stack:
            ends[open_stack.pop()] = pos + 1
        pos += 1
    return ends


def atomize(text: str) -> list[Atom]:
    """Split `text` into atoms; their texts concatenate back to `text` exactly."""
    atoms: list[Atom] = []
    word_start = None  # start of the word being collected
    directions = direction_ends(text)

    def flush_word(end: int) -> None:
        nonlocal word_start
        if word_start is not None and word_start < end:
            atoms.append(Atom(text[word_start:end], "word", word_start))
        word_start = None

    pos = 0
    while pos < len(text):
        char = text[pos]
        atom = None
        if char == "<":
            if m := SPECIAL_TAG.match(text, pos):
                kind = "speaker" if SPEAKER_TAG.fullmatch(m.group()) else "special"
                atom = Atom(m.group(), kind, pos)
            elif m := WORD_TAG.match(text, pos):
                atom = Atom(m.group(), "close" if m.group(1) else "open", pos, name=m.group(2))
        elif char == "[":
            if pos in directions:
                atom = Atom(text[pos:directions[pos]], "direction", pos)
        elif char.isspace():
            m = WHITESPACE.match(text, pos)
            atom = Atom(m.group(), "space", pos)
        elif is_cjk(char):
            atom = Atom(char, "word", pos)
        if atom is None:
            if word_start is None:
                word_start = pos
            pos += 1
            continue
        flush_word(pos)
        atoms.append(atom)
        pos = atom.end
    flush_word(len(text))
    return atoms


def word_tag_pairs(atoms: list[Atom]) -> list[tuple[int, int]]:
    """(open index, close index) of each matched `<name>…</name>` pair; a close matches the latest
    unmatched open of the same name, and unmatched tags pair with nothing."""
    pairs = []
    open_stack: list[int] = []
    for i, atom in enumerate(atoms):
        if atom.kind == "open":
            open_stack.append(i)
        elif atom.kind == "close":
            for j in range(len(open_stack) - 1, -1, -1):
                if atoms[open_stack[j]].name == atom.name:
                    pairs.append((open_stack[j], i))
                    del open_stack[j:]  # tags opened inside and never closed stay unmatched
                    break
    return pairs


def _ends_with(atom: Atom, marks: frozenset) -> bool:
    body = atom.text.rstrip(CLOSERS)
    return bool(body) and body[-1] in marks


def boundary_ranks(atoms: list[Atom]) -> list[int]:
    """ranks[k] = rank of the cut before atom k (index 0 is unused)."""
    ranks = [RANK_OTHER] * (len(atoms) + 1)
    for k in range(1, len(atoms) + 1):
        before = atoms[k - 1]
        after = atoms[k] if k < len(atoms) else None
        if after is not None and after.kind == "speaker":
            rank = RANK_SPEAKER
        elif (before.kind == "word" and _ends_with(before, SENTENCE_END)) or any(
                a is not None and a.kind == "space" and "\n" in a.text for a in (before, after)):
            rank = RANK_SENTENCE
        elif before.kind == "word" and _ends_with(before, CLAUSE_END):
            rank = RANK_CLAUSE
        elif before.kind == "space" or (after is not None and after.kind == "space"):
            rank = RANK_SPACE
        else:
            rank = RANK_OTHER
        ranks[k] = rank
    # Boundaries open_index+1 .. close_index of each pair are inside it; count the pairs covering
    # each boundary with a difference array (pairs can nest thousands deep in hostile text).
    covering = [0] * (len(atoms) + 2)
    for open_index, close_index in word_tag_pairs(atoms):
        covering[open_index + 1] += 1
        covering[close_index + 1] -= 1
    depth = 0
    for k in range(1, len(atoms) + 1):
        depth += covering[k]
        if depth > 0:
            ranks[k] -= INSIDE_WORD_TAG_PENALTY
    return ranks


def speakers_in_force(atoms: list[Atom], default: str | None) -> list[str | None]:
    """in_force[k] = the speaker tag in force just before atom k (`default` before the first)."""
    in_force, current = [], default
    for atom in atoms:
        in_force.append(current)
        if atom.kind == "speaker":
            current = atom.text
    in_force.append(current)
    return in_force


def split_text(text: str, chunk_size: int) -> list[str]:
    """Cut `text` into chunks of at most `chunk_size` code points (MODEL.md §8.3).

    Each chunk is stripped and, when the text has speaker tags, starts with one (the tag in force
    is prepended where needed). Raises ValueError for chunk_size < 1.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    atoms = atomize(text)
    ranks = boundary_ranks(atoms)
    default_speaker = "<|speaker:0|>" if any(a.kind == "speaker" for a in atoms) else None
    in_force = speakers_in_force(atoms, default_speaker)

    def prefix_for(start: int) -> str:
        """The speaker tag a chunk starting at atom `start` needs in front, or ''."""
        first = next((atoms[k] for k in range(start, len(atoms)) if atoms[k].kind != "space"), None)
        if first is None or first.kind == "speaker":
            return ""
        return in_force[start] or ""

    pieces: list[tuple[int, int]] = []  # atom ranges [start, end)
    start = 0
    length = len(prefix_for(0))
    i = 0
    while i < len(atoms):
        atom = atoms[i]
        if atom.kind == "space" and i == start:
            start += 1  # leading whitespace is dropped, not counted
            i += 1
            continue
        if length + len(atom.text) <= chunk_size or i == start:
            length += len(atom.text)
            i += 1
            if i == start + 1 and length > chunk_size:  # a single atom too long: its own chunk
                pieces.append((start, i))
                start, length = i, len(prefix_for(i))
            continue
        # The next atom would pass the limit: cut at the best boundary, latest among equals.
        cut = max(range(start + 1, i + 1), key=lambda k: (ranks[k], k))
        pieces.append((start, cut))
        start, i = cut, cut
        length = len(prefix_for(cut))
    if start < len(atoms):
        pieces.append((start, len(atoms)))

    chunks = []
    for begin, end in pieces:
        body = "".join(a.text for a in atoms[begin:end]).strip()
        if all(a.kind in ("speaker", "space") for a in atoms[begin:end]):
            continue  # nothing to say
        chunks.append(prefix_for(begin) + body)
    return chunks
