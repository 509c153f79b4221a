"""English text normalization for the `normalize` flag (API.md §2.1): spell out numbers, simple
dates, times, currency and units, so the model reads "$5.50" as "five dollars and fifty cents".

Modest on purpose: only ASCII digits are touched, and anything inside a tag (`<|…|>`, `[…]`,
`<…>`) is kept as written. Every rule replaces the digits it reads, so the output of a pass holds
no ASCII digits outside tags and a second pass changes nothing (idempotent).
"""

from __future__ import annotations

import re
from typing import Callable

from gateway.chunking import atomize

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
        "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
SCALES = [(10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand")]
ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth",
                 "eight": "eighth", "nine": "ninth", "twelve": "twelfth"}
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]

# unit -> (singular, plural); matched right after a number, as a whole word.
UNITS = {
    "%": ("percent", "percent"), "km": ("kilometer", "kilometers"), "m": ("meter", "meters"),
    "cm": ("centimeter", "centimeters"), "mm": ("millimeter", "millimeters"),
    "kg": ("kilogram", "kilograms"), "g": ("gram", "grams"), "mg": ("milligram", "milligrams"),
    "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"), "mi": ("mile", "miles"),
    "ft": ("foot", "feet"), "mph": ("mile per hour", "miles per hour"),
    "km/h": ("kilometer per hour", "kilometers per hour"), "kmh": ("kilometer per hour", "kilometers per hour"),
    "°C": ("degree Celsius", "degrees Celsius"), "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "ms": ("millisecond", "milliseconds"), "s": ("second", "seconds"), "min": ("minute", "minutes"),
    "h": ("hour", "hours"), "GB": ("gigabyte", "gigabytes"), "MB": ("megabyte", "megabytes"),
    "kB": ("kilobyte", "kilobytes"), "Hz": ("hertz", "hertz"), "kHz": ("kilohertz", "kilohertz"),
}
CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
              "£": ("pound", "pounds", "penny", "pence")}

# Single-letter units only count after a space: "5 s" is five seconds, "1990s" is a decade.
SPACED_UNITS = frozenset({"m", "g", "s", "h"})

_UNIT_ALT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True) if u not in SPACED_UNITS)
_SPACED_ALT = "|".join(sorted(SPACED_UNITS))
# At most 15 digits: longer runs are read digit by digit (and never reach int(), which refuses
# strings past 4300 digits).
NUMBER = r"(?:[0-9]{1,3}(?:,[0-9]{3}){1,4}|[0-9]{1,15})(?![0-9])"
ISO_DATE = re.compile(r"\b([0-9]{4})-([0-9]{2})-([0-9]{2})\b")
TIME = re.compile(r"\b([0-9]{1,2}):([0-9]{2})\b(?:\s?([AaPp])\.?[Mm]\b)?")
CURRENCY = re.compile(r"([$€£])(" + NUMBER + r")(?:\.([0-9]{2}))?\b")
ORDINAL = re.compile(r"\b([0-9]{1,15})(st|nd|rd|th)\b")
WITH_UNIT = re.compile(r"(?<![\w.])(-?)(" + NUMBER + r")(?:\.([0-9]+))?(?:\s?(" + _UNIT_ALT + r")|\s("
                       + _SPACED_ALT + r"))(?!\w)")
DECADE = re.compile(r"\b([0-9]{1,3}0)s\b")
DECIMAL = re.compile(r"(?<![\w.])(-?)(" + NUMBER + r")\.([0-9]+)(?![0-9])")
INTEGER = re.compile(r"(?<![\w])(-?)(" + NUMBER + r")")
DIGITS = re.compile(r"[0-9]+")


def number_to_words(n: int) -> str:
    """0 -> 'zero', 1234 -> 'one thousand two hundred thirty-four' (negatives get 'minus')."""
    if n < 0:
        return "minus " + number_to_words(-n)
    if n < 20:
        return ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return TENS[tens] + (f"-{ONES[ones]}" if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return f"{ONES[hundreds]} hundred" + (f" {number_to_words(rest)}" if rest else "")
    if n >= 10**15:
        return digits_to_words(str(n))  # beyond the trillions: read digit by digit
    for scale, name in SCALES:
        if n >= scale:
            high, rest = divmod(n, scale)
            return f"{number_to_words(high)} {name}" + (f" {number_to_words(rest)}" if rest else "")
    raise AssertionError("unreachable")


def digits_to_words(digits: str) -> str:
    """'0314' -> 'zero three one four'."""
    return " ".join(ONES[int(d)] for d in digits if d != ",")


def ordinal_words(n: int) -> str:
    """21 -> 'twenty-first', 100 -> 'one hundredth'."""
    words = number_to_words(n)
    head, sep, last = words.rpartition("-") if "-" in words.split(" ")[-1] else words.rpartition(" ")
    if last in ORDINAL_WORDS:
        last = ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last


def year_words(year: int) -> str:
    """1990 -> 'nineteen ninety', 1905 -> 'nineteen oh five', 2000 -> 'two thousand',
    2008 -> 'two thousand eight', 2024 -> 'twenty twenty-four'."""
    high, low = divmod(year, 100)
    if year % 1000 < 10 and year >= 2000:
        return number_to_words(year)
    if low == 0:
        return f"{number_to_words(high)} hundred"
    if low < 10:
        return f"{number_to_words(high)} oh {ONES[low]}"
    return f"{number_to_words(high)} {number_to_words(low)}"


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _plural(value_text: str, fraction: str | None) -> bool:
    return fraction is not None or _int(value_text) != 1


def _date(m: re.Match) -> str:
    year, month, day = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return " ".join(number_to_words(int(g)) for g in m.groups())
    return f"{MONTHS[month - 1]} {ordinal_words(day)}, {year_words(year)}"


def _time(m: re.Match) -> str:
    hour, minute, meridiem = int(m.group(1)), int(m.group(2)), m.group(3)
    if hour > 23 or minute > 59:
        return f"{number_to_words(hour)} {number_to_words(minute)}"
    if minute == 0:
        words = f"{number_to_words(hour)} o'clock" if not meridiem else number_to_words(hour)
    elif minute < 10:
        words = f"{number_to_words(hour)} oh {ONES[minute]}"
    else:
        words = f"{number_to_words(hour)} {number_to_words(minute)}"
    if meridiem:
        words += " a m" if meridiem.lower() == "a" else " p m"
    return words


def _currency(m: re.Match) -> str:
    one, many, cent, cents = CURRENCIES[m.group(1)]
    units, fraction = _int(m.group(2)), m.group(3)
    words = f"{number_to_words(units)} {one if units == 1 else many}"
    if fraction and int(fraction):
        words += f" and {number_to_words(int(fraction))} {cent if int(fraction) == 1 else cents}"
    return words


def _decimal_words(sign: str, whole: str, fraction: str | None) -> str:
    words = ("minus " if sign else "") + number_to_words(_int(whole))
    if fraction is not None:
        words += " point " + digits_to_words(fraction)
    return words


def _with_unit(m: re.Match) -> str:
    sign, whole, fraction, unit, spaced_unit = m.groups()
    unit = unit or spaced_unit
    one, many = UNITS[unit]
    name = many if _plural(whole, fraction) else one
    return f"{_decimal_words(sign, whole, fraction)} {name}"


def _integer(m: re.Match) -> str:
    sign, digits = m.groups()
    if not sign and "," not in digits and len(digits) == 4 and 1100 <= int(digits) <= 2099:
        return year_words(int(digits))  # a bare four-digit number in this range reads as a year
    if digits.startswith("0") and len(digits) > 1:
        return ("minus " if sign else "") + digits_to_words(digits)  # codes, zip codes: digit by digit
    return ("minus " if sign else "") + number_to_words(_int(digits))


def _decade(m: re.Match) -> str:
    """'1990s' -> 'nineteen nineties', '80s' -> 'eighties'."""
    value = int(m.group(1))
    words = year_words(value) if 1100 <= value <= 2099 else number_to_words(value)
    return words[:-1] + "ies" if words.endswith("y") else words + "s"


def _spaced(words_for: Callable[[re.Match], str]) -> Callable[[re.Match], str]:
    """A number glued to a following letter ("3cats", "1.5x") is set off by a space."""
    def replace(m: re.Match) -> str:
        words = words_for(m)
        return words + " " if m.end() < len(m.string) and m.string[m.end()].isalpha() else words
    return replace


def _spell_digits(m: re.Match) -> str:
    """Digits glued to letters ("mp3"): one by one, set off by spaces from the letters."""
    text = m.string
    before = " " if m.start() > 0 and text[m.start() - 1].isalnum() else ""
    after = " " if m.end() < len(text) and text[m.end()].isalnum() else ""
    return before + digits_to_words(m.group()) + after


def normalize_plain(text: str) -> str:
    """Normalize text that holds no tags."""
    text = ISO_DATE.sub(_date, text)
    text = DECADE.sub(_decade, text)
    text = TIME.sub(_time, text)
    text = CURRENCY.sub(_currency, text)
    text = ORDINAL.sub(lambda m: ordinal_words(int(m.group(1))), text)
    text = WITH_UNIT.sub(_with_unit, text)
    text = DECIMAL.sub(_spaced(lambda m: _decimal_words(*m.groups())), text)
    text = INTEGER.sub(_spaced(_integer), text)
    return DIGITS.sub(_spell_digits, text)  # what is left is glued to letters ("mp3", "A4")


def normalize_text(text: str) -> str:
    """Spell out numbers, dates, times, currency and units outside tags; idempotent.

    Tags are found by the chunker's own atomizer, so normalization and chunking agree on what a
    tag is (nested directions included)."""
    pieces: list[str] = []
    plain: list[str] = []
    for atom in atomize(text):
        if atom.kind in ("word", "space"):
            plain.append(atom.text)
            continue
        pieces.append(normalize_plain("".join(plain)))
        plain = []
        pieces.append(atom.text)
    pieces.append(normalize_plain("".join(plain)))
    return "".join(pieces)
