r"""Final answers of math completions: GSM8K's ``#### 42``, LaTeX's ``\boxed{...}``, and their normalisation.

GSM8K (as the common graders, e.g. verl's): the answer is the number after the last ``####``; commas, ``$`` and a
trailing ``.`` are dropped and the numbers compared by value (``1,000.00`` equals ``1000``). ``flexible`` takes the
last number of the text instead.

Boxed answers (as the MATH graders' ``strip_string``): the content of the last ``\boxed{...}`` (nested braces
matched) or ``\fbox{...}``; normalised by dropping spaces, ``\left``/``\right``, ``\!``/``\,``/``\;``, ``$``,
``\%``, degree marks, units written after the number as ``\text{ cm}`` (a ``\text{`` opening with a space),
``\text{...}`` wrappers and a trailing ``.``; ``\dfrac``/``\tfrac`` -> ``\frac``;
``\frac12`` -> ``\frac{1}{2}``, ``\sqrt2`` -> ``\sqrt{2}``, ``a/b`` -> ``\frac{a}{b}``; a leading ``x=`` dropped;
thousands commas dropped. Two answers are equal when their normal forms are, or when both are rational numbers
(integers, decimals, ``\frac{a}{b}``, signs) of equal value.
"""

from __future__ import annotations

import decimal
import fractions
import re

_GSM8K_STRICT = re.compile(r"####\s*(-?[$0-9.,]+)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


def parse_number(text: str) -> decimal.Decimal | None:
    """``text`` as a number after dropping commas, ``$`` and a trailing ``.``; None if it is not one.

    >>> parse_number("$1,000.") == parse_number("1000.00")
    True
    >>> parse_number("12a") is None
    True
    """
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", text):
        return None
    return decimal.Decimal(text)


def gsm8k_reference(answer: str) -> decimal.Decimal | None:
    """The number of a GSM8K reference answer: after its last ``####`` (the dataset's form), else the whole text."""
    answer = str(answer)
    return parse_number(answer.rpartition("####")[2] if "####" in answer else answer)


def gsm8k_extract(completion: str, method: str = "strict") -> decimal.Decimal | None:
    """The final number of a completion: after the last ``####`` (``strict``), or its last number (``flexible``).

    >>> str(gsm8k_extract("3 + 4 = 7 apples. #### 7."))
    '7'
    >>> gsm8k_extract("3 + 4 = 7") is None, str(gsm8k_extract("3 + 4 = 7", "flexible"))
    (True, '7')
    """
    if method == "strict":
        matches = _GSM8K_STRICT.findall(completion)
    elif method == "flexible":
        matches = _NUMBER.findall(completion)
    else:
        raise ValueError(f"method={method!r}: use 'strict' or 'flexible'")
    for match in reversed(matches):
        number = parse_number(match)
        if number is not None:
            return number
    return None


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` or ``\fbox{...}`` of ``text`` (nested braces matched), or of
    ``\boxed x`` up to the next space or ``$``; None if there is none or its braces do not close.

    >>> last_boxed(r"so \boxed{1} or rather \boxed{\frac{1}{\sqrt{2}}}.")
    '\\frac{1}{\\sqrt{2}}'
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):
        return re.split(r"[\s$]", rest[1:], maxsplit=1)[0] or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    return None


def _unwrap(text: str, command: str) -> str:
    """``\\command{x}`` -> ``x`` (innermost first, braces matched)."""
    pattern = re.compile(re.escape(command) + r"\{([^{}]*)\}")
    while True:
        text, count = pattern.subn(r"\1", text)
        if not count:
            return text


def _fix_fracs(text: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{2}`` -> ``\frac{1}{2}``, ``\frac{1}2`` -> ``\frac{1}{2}``."""
    text = re.sub(r"\\frac([0-9a-zA-Z])([0-9a-zA-Z])", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac([0-9a-zA-Z])\{", r"\\frac{\1}{", text)
    return re.sub(r"\\frac\{([^{}]*)\}([0-9a-zA-Z])", r"\\frac{\1}{\2}", text)


def normalize_latex(answer: str) -> str:
    r"""The normal form of a LaTeX answer (see the module docstring).

    >>> normalize_latex(r"\left( \dfrac{1}{2}, 3 \right).")
    '(\\frac{1}{2},3)'
    >>> normalize_latex(r"x = 10\%"), normalize_latex(r"1{,}000"), normalize_latex("3/4")
    ('10', '1000', '\\frac{3}{4}')
    >>> normalize_latex(r"12\text{ cm}^2"), normalize_latex(r"\text{Monday}")
    ('12', 'Monday')
    """
    text = answer.replace("\n", "").strip()
    for units in ("\\text{ ", "\\mbox{ "):  # "12\text{ cm}": units after the number (the MATH graders' rule)
        if units in text[1:]:
            text = text[:text.index(units, 1)]
    for old, new in (("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\left", ""), ("\\right", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^{\\circ}", ""), ("^\\circ", ""),
                     ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("{,}", ""), ("\\displaystyle", "")):
        text = text.replace(old, new)
    for command in ("\\text", "\\textbf", "\\mathrm", "\\mbox"):
        text = _unwrap(text, command)
    text = re.sub(r"\\sqrt([0-9a-zA-Z])", r"\\sqrt{\1}", text)
    text = text.replace(" ", "").rstrip(".")
    if re.fullmatch(r"[a-zA-Z]\w{0,1}=.+", text):
        text = text.split("=", 1)[1]  # "x=5" -> "5"
    if re.fullmatch(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?", text):
        text = text.replace(",", "")
    text = re.sub(r"(^|[^0-9])\.([0-9])", r"\g<1>0.\2", text)  # ".5" -> "0.5"
    text = _fix_fracs(text)
    if re.fullmatch(r"-?[0-9]+/[0-9]+", text):
        sign, (numerator, denominator) = "-" * text.startswith("-"), text.lstrip("-").split("/")
        text = f"{sign}\\frac{{{numerator}}}{{{denominator}}}"
    return text


def _rational(text: str) -> fractions.Fraction | None:
    """A normal form's value if it is a rational number: ``-3``, ``0.25``, ``\\frac{1}{4}``, ``-\\frac{1}{4}``."""
    match = re.fullmatch(r"(-?)\\frac\{(-?[0-9]+)\}\{([0-9]+)\}", text)
    if match:
        if int(match[3]) == 0:
            return None
        value = fractions.Fraction(int(match[2]), int(match[3]))
        return -value if match[1] else value
    if re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", text):
        return fractions.Fraction(text)
    return None


def equivalent_latex(answer: str, reference: str) -> bool:
    r"""Whether two LaTeX answers are equal after normalisation, or equal rational numbers.

    >>> equivalent_latex(r"\dfrac{1}{2}", "0.5"), equivalent_latex(r"\frac12", r"\frac{1}{2}")
    (True, True)
    >>> equivalent_latex(r"\sqrt{2}", "2")
    False
    """
    answer, reference = normalize_latex(answer), normalize_latex(reference)
    if answer == reference:
        return True
    a, b = _rational(answer), _rational(reference)
    return a is not None and a == b
