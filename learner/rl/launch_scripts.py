"""Launch scripts as their users keep them: the Hydra overrides of a verl script's ``python3 -m
verl.trainer.main_ppo`` command (nested, with the shell variables the script sets expanded), or the arguments of a
slime script (its bash arrays and its ``train.py`` line).

Not a shell: it reads what verl's launch scripts do to build that command, as bash would, without running anything.
Line continuations, comments, single and double quotes, backslashes, redirections; ``NAME=value``, ``export
NAME=value`` and arrays ``NAME=( ... )`` at the top level of the script, in order; ``$NAME``, ``${NAME}``,
``${NAME:-default}`` (and ``-``, ``:=``, ``:+``, ``+``), ``"${NAME[@]}"``, ``$((arithmetic))``, with field
splitting of unquoted expansions; ``$@``, ``"${@:2}"`` and the positional parameters are empty (no arguments are
passed). A variable the script does not set (``$HOME``) stays as text, whatever the reader's environment holds;
assignments inside ``if``, ``for``, ``while`` and ``case`` blocks are not followed; ``$(command)`` is not run and
stays as text (one word). Values are read as Hydra reads them: ints, floats, ``true``/``false``, ``null``,
``[lists]`` and ``{dicts}``, quoted text as text.
"""

from __future__ import annotations

import ast
import operator
import pathlib
import re
import shlex
from typing import Any

from learner.rl.hydra_defaults import hydra_command

__all__ = ["hydra_value", "launch_script_arguments", "read_launch_script", "verl_arguments", "verl_overrides"]

VERL_COMMAND = "verl.trainer.main_ppo"
# verl's own config names for that command: their defaults are the ones the front door and the run mapping fill in.
STOCK_CONFIG_NAMES = ("ppo_trainer", "ppo_megatron_trainer")
_OPERATOR = re.compile(r"&&|\|\||;;|[;|&\n]")  # ends a statement
_REDIRECTION = re.compile(r"[<>&|]+")
_QUOTED_PLAIN = re.compile(r'[^"\\$]+')  # characters with no meaning inside double quotes
_UNQUOTED_PLAIN = re.compile(r"[^'\"\\$]+")  # characters a raw word keeps as they are
_PLAIN = re.compile(r"[^\s'\"\\$;&|<>(#]+")  # characters with no meaning to the shell, in a word
_OPENERS = {"if": 1, "for": 1, "while": 1, "until": 1, "case": 1, "select": 1, "fi": -1, "done": -1, "esac": -1}
_LEADERS = {"then", "else", "do", "elif", "!", "{", "}", "time"}
_NAME = r"[A-Za-z_]\w*"
_DOLLAR = re.compile(rf"\$({_NAME}|[0-9@*#?$!-])?")  # $NAME, $1, $@, ...: a plain expansion


def read_launch_script(text: str, path: str | pathlib.Path) -> dict | list[str]:
    """A verl script's nested overrides, or a slime script's argument tokens; a script with neither raises, naming
    what was looked for (an empty result would read as the framework's defaults)."""
    try:
        overrides = verl_overrides(text, path)
    except RecursionError:  # quotes and expansions nested thousands deep
        raise ValueError(f"{path}: quotes or $(...) nested too deeply to read.") from None
    if overrides is not None:
        return overrides
    tokens = launch_script_arguments(text)
    if not tokens:
        raise ValueError(f"{path}: no launch command found: a verl script runs python3 -m {VERL_COMMAND} "
                         "with key=value overrides; a slime script gives --arguments in bash arrays "
                         "(ARGS=( ... )) or on its train.py line.")
    return tokens


def verl_overrides(text: str, path: str | pathlib.Path = "script") -> dict | None:
    """The nested Hydra overrides of the script's ``verl.trainer.main_ppo`` command; None without one.

    >>> script = 'N=${N:-5}\\npython3 -m verl.trainer.main_ppo \\\\\\n  actor_rollout_ref.rollout.n=$N \\\\\\n' \\
    ...          '  +data.seed=$((2 * 4)) trainer.logger=\\'["console"]\\' $@'
    >>> verl_overrides(script)
    {'actor_rollout_ref': {'rollout': {'n': 5}}, 'data': {'seed': 8}, 'trainer': {'logger': ['console']}}
    """
    arguments = verl_arguments(text, path)
    return None if arguments is None else _overrides(arguments, path)


def verl_arguments(text: str, path: str | pathlib.Path = "script") -> list[str] | None:
    """The arguments of the script's ``python3 -m verl.trainer.main_ppo`` command as the shell passes them, with the
    variables set before it; None without one."""
    variables: dict[str, str | list[str]] = {}
    depth = 0
    for words in _statements(text.replace("\\\n", ""), path):
        while words and words[0] in _LEADERS:
            words = words[1:]
        if not words:
            continue
        if words[0] in _OPENERS:
            depth = max(depth + _OPENERS[words[0]], 0)
            continue
        for index, word in enumerate(words[:-1]):
            if word == "-m" and _expand(words[index + 1], variables, path) == [VERL_COMMAND]:
                return [str(argument) for raw in words[index + 2:] for argument in _expand(raw, variables, path)]
        if depth == 0:
            _assign(words, variables, path)
    return None


def _assign(words: list[str], variables: dict[str, str | list[str]], path) -> None:
    """Sets the variables of a statement made of assignments (``export``, ``declare``, ``readonly`` allowed); a
    statement that runs a command with assignments before it sets them for that command only."""
    if words[0] in ("export", "declare", "readonly", "local"):
        words = [word for word in words[1:] if not word.startswith("-")]
    assignments = [re.fullmatch(rf"({_NAME})=(.*)", word, flags=re.S) for word in words]
    if not all(assignments):
        return
    for match in assignments:
        name, value = match.group(1), match.group(2)
        if value.startswith("("):  # an array: its words, each expanded
            words = [raw for statement in _statements(value[1:-1], path) for raw in statement]
            variables[name] = [word for raw in words for word in _expand(raw, variables, path)]
        else:
            variables[name] = _expand_one(value, variables, path)


def _statements(text: str, path) -> list[list[str]]:
    """The script's statements as lists of raw words (quotes kept), split at newlines and ``; && || | &``;
    comments and redirections dropped."""
    statements: list[list[str]] = []
    words: list[str] = []
    parts: list[str] = []  # of the word being read
    redirected = False  # after > or <: the rest of the statement is redirections, not arguments
    i = 0
    while i < len(text):
        char = text[i]
        plain = _PLAIN.match(text, i)
        operator_ = None if plain else _OPERATOR.match(text, i)
        if plain:
            parts.append(plain.group())
            i = plain.end()
        elif char in "<>" and not "".join(parts).strip("0123456789&"):  # 2>&1, > log, < input
            parts, redirected = [], True
            i = _REDIRECTION.match(text, i).end()
        elif char in " \t\r" or operator_:
            if parts and not redirected:
                words.append("".join(parts))
            parts = []
            if operator_:
                if words:
                    statements.append(words)
                words, redirected = [], False
            i = operator_.end() if operator_ else i + 1
        elif char == "(" and re.fullmatch(rf"{_NAME}=", "".join(parts)):  # an array: NAME=( words... )
            end = _closing_paren(text, i, path)
            parts.append(text[i:end])
            i = end
        elif char == "#" and not parts:
            i = _line_end(text, i)
        else:
            end = _word_part_end(text, i, path)
            parts.append(text[i:end])
            i = end
    if parts and not redirected:
        words.append("".join(parts))
    if words:
        statements.append(words)
    return statements


def _line_end(text: str, i: int) -> int:
    """The index of the newline that ends the line holding ``i`` (the text's end on its last line)."""
    end = text.find("\n", i)
    return len(text) if end < 0 else end


def _closing_paren(text: str, i: int, path) -> int:
    """The end of the ``( ... )`` starting at ``i`` (quotes and comments inside skipped)."""
    depth, j = 0, i
    while j < len(text):
        if text[j] in "'\"\\$":
            j = _word_part_end(text, j, path)
            continue
        if text[j] == "#" and text[j - 1] in " \t\n(":
            j = _line_end(text, j)
            continue
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        j += 1
        if depth == 0:
            return j
    raise ValueError(f"{path}: ( is not closed ({text[i:i + 40]!r}...).")


def _word_part_end(text: str, i: int, path) -> int:
    """The end of the word part starting at ``i``: a quoted string, an escaped character, a ``$`` expansion or one
    plain character."""
    char = text[i]
    if char == "'":
        end = text.find("'", i + 1)
        if end < 0:
            raise ValueError(f"{path}: a single quote is not closed ({text[i:i + 40]!r}...).")
        return end + 1
    if char == '"':
        j = i + 1
        while j < len(text) and text[j] != '"':
            j = _word_part_end(text, j, path) if text[j] in "\\$" else _QUOTED_PLAIN.match(text, j).end()
        if j >= len(text):
            raise ValueError(f"{path}: a double quote is not closed ({text[i:i + 40]!r}...).")
        return j + 1
    if char == "\\":
        return min(i + 2, len(text))
    if char == "$" and text.startswith(("$(", "${"), i):
        opening, closing = text[i + 1], {"(": ")", "{": "}"}[text[i + 1]]
        depth, j = 0, i + 1
        while j < len(text):
            if text[j] in "'\"\\":
                j = _word_part_end(text, j, path)
                continue
            depth += {opening: 1, closing: -1}.get(text[j], 0)
            j += 1
            if depth == 0:
                return j
        raise ValueError(f"{path}: {text[i:i + 2]} is not closed ({text[i:i + 40]!r}...).")
    return i + 1


def _expand(raw: str, variables: dict[str, str | list[str]], path, split: bool = True) -> list[str]:
    """The words of a raw word after the shell's expansions, field splitting (``split``: an unquoted expansion
    holding blanks gives several words, as ``$ACTOR_CONFIG`` does; not in an assignment) and quote removal: none
    for an unquoted empty expansion or ``"$@"``, an array's words for ``"${NAME[@]}"``."""
    if re.fullmatch(r'"?\$(@|\*|\{[@*][^}]*\})"?', raw):
        return []
    array = re.fullmatch(rf'"?\$\{{({_NAME})\[[@*]\]\}}"?', raw)
    if array and isinstance(variables.get(array.group(1)), list):
        return list(variables[array.group(1)])
    fields: list[list[str]] = [[]]
    quoted: list[bool] = [False]
    kept: list[bool] = [False]  # holds text kept as written (_Text)

    def add(text: str, is_quoted: bool = False, splits: bool = False) -> None:
        splits = splits and split and not isinstance(text, _Text)
        for k, piece in enumerate(re.split(r"[ \t\n]+", text) if splits else [text]):
            if k:
                fields.append([])
                quoted.append(False)
                kept.append(False)
            fields[-1].append(piece)
            quoted[-1] = quoted[-1] or is_quoted
            kept[-1] = kept[-1] or isinstance(text, _Text)

    i = 0
    while i < len(raw):
        char = raw[i]
        end = _word_part_end(raw, i, path)
        if char == "'":
            add(raw[i + 1:end - 1], is_quoted=True)
        elif char == '"':
            inner, j = raw[i + 1:end - 1], 0
            add("", is_quoted=True)
            while j < len(inner):
                if inner[j] == "\\":
                    stop = min(j + 2, len(inner))
                else:
                    stop = _dollar_end(inner, j, path) if inner[j] == "$" else _QUOTED_PLAIN.match(inner, j).end()
                part = inner[j:stop]
                if part.startswith("\\"):
                    add(part[1:] if part[1:] in ('"', "\\", "$", "`") else part)
                else:
                    add(_dollar(part, variables, path) if part.startswith("$") else part)
                j = stop
        elif char == "\\":
            add(raw[i + 1:end])
        elif char == "$":
            end = _dollar_end(raw, i, path)
            add(_dollar(raw[i:end], variables, path), splits=True)
        else:
            end = _UNQUOTED_PLAIN.match(raw, i).end()
            add(raw[i:end])
        i = end
    words = [_Text("".join(parts)) if is_kept else "".join(parts) for parts, is_kept in zip(fields, kept)]
    return [word for word, is_quoted in zip(words, quoted) if word or is_quoted]


def _expand_one(raw: str, variables: dict[str, str | list[str]], path) -> str:
    """A raw word expanded without field splitting, as in an assignment (``_Text`` where it keeps text)."""
    words = _expand(raw, variables, path, split=False)
    return words[0] if words else ""


def _dollar_end(raw: str, i: int, path) -> int:
    if raw.startswith(("$(", "${"), i):
        return _word_part_end(raw, i, path)
    return _DOLLAR.match(raw, i).end()


class _Text(str):
    """Shell text this reader keeps as written (``$(command)``, arithmetic it cannot do, a variable the script does
    not set): one word, never split at its blanks."""


def _dollar(part: str, variables: dict[str, str | list[str]], path) -> str:
    """One ``$`` expansion: a variable (with its ``${NAME:-default}`` forms), arithmetic, or the text as it is."""
    if part.startswith("$(("):
        return _arithmetic(part[3:-2], variables, _Text(part))
    if part.startswith("$("):
        return _Text(part)  # a command substitution: not run
    name = part[2:-1] if part.startswith("${") else part[1:]
    match = re.fullmatch(rf"({_NAME}|[0-9]+|[@*])(:?[-=+])?(.*)", name, flags=re.S)
    if not match:
        return _Text(part)  # $#, ${#NAME}, ${NAME/a/b}, a lone $: as text
    name, form, word = match.groups()
    if name.isdigit() or name in "@*":
        value = None if name != "0" else str(path)  # no arguments are passed
    else:
        value = variables.get(name)
        value = (value[:1] or [""])[0] if isinstance(value, list) else value  # $ARRAY: its first word
    if form is None:
        return _Text(part) if value is None and not (name.isdigit() or name in "@*") else value or ""
    empty = value is None or (form.startswith(":") and value == "")
    if form.endswith("+"):
        return "" if empty else _expand_one(word, variables, path)
    if not empty:
        return value
    default = _expand_one(word, variables, path)
    if form.endswith("=") and not (name.isdigit() or name in "@*"):
        variables[name] = default
    return default


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
               ast.Pow: operator.pow, ast.Div: lambda a, b: int(a / b), ast.FloorDiv: lambda a, b: int(a / b)}


def _arithmetic(expression: str, variables: dict[str, str | list[str]], text: str) -> str:
    """``$((...))``: integer + - * / % ** and parentheses over numbers and variables (an unset one is 0, as in the
    shell), within the shell's 64 bits; anything else stays as text."""
    expression = re.sub(r"\$\{?(" + _NAME + r")\}?", r"\1", expression)

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return int(variables.get(node.id) or 0)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and not 0 <= right < 64:
                raise ValueError(node)  # 9**9**9 would not end
            result = _ARITHMETIC[type(node.op)](left, right)
            if abs(result) >= 1 << 63:
                raise ValueError(node)
            return result
        raise ValueError(node)

    try:
        return str(value(ast.parse(expression.strip(), mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError):
        return text


def _overrides(arguments: list[str], path) -> dict:
    """Hydra's command-line overrides (``key=value``, ``+key=value``, ``++key=value``) as a nested dict, later ones
    replacing earlier ones; ``--config-name`` must be one of verl's own."""
    out: dict = {}
    i = 0
    while i < len(arguments):
        argument = arguments[i]
        flag = re.fullmatch(r"(--config-name|-cn|--config-path|-cp|--config-dir|-cd)(?:=(.*))?", argument, re.S)
        if flag:
            value = flag.group(2) if flag.group(2) is not None else (arguments[i + 1] if i + 1 < len(arguments)
                                                                     else "")
            i += 1 if flag.group(2) is not None else 2
            name = pathlib.PurePath(value).stem
            if flag.group(1) in ("--config-name", "-cn") and name not in STOCK_CONFIG_NAMES:
                raise ValueError(f"{path}: --config-name {value} is not one of verl's own configs "
                                 f"({', '.join(STOCK_CONFIG_NAMES)}), which this reader does not compose; compose "
                                 f"and resolve it first: {hydra_command('verl')}, then give resolved.yaml.")
            continue
        i += 1
        if argument.startswith("~"):
            raise ValueError(f"{path}: {argument!r} deletes a key of verl's config, which this reader does not "
                             f"follow; compose and resolve the config first: {hydra_command('verl')}")
        key, equals, text = argument.lstrip("+").partition("=")
        if not equals or not re.fullmatch(r"[\w@/-]+(\.[\w@/-]+)*", key):
            raise ValueError(f"{path}: {argument!r} after {VERL_COMMAND} is not a Hydra override "
                             "(key=value, +key=value or ++key=value).")
        _set(out, key, hydra_value(text), path)
    return out


def _set(out: dict, key: str, value: Any, path) -> None:
    *parents, leaf = key.split(".")
    node = out
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{path}: {'.'.join(parents[:depth + 1])} is given both as a value and as a section.")
    if isinstance(node.get(leaf), dict) and not isinstance(value, dict):
        raise ValueError(f"{path}: {key} is given both as a value and as a section.")
    node[leaf] = value


def hydra_value(text: str) -> Any:
    """A command-line value as Hydra reads it.

    >>> [hydra_value(t) for t in ["5", "1e-6", "True", "null", "'0.5'", "low_var_kl", '["a","b"]', "0.999_1.001"]]
    [5, 1e-06, True, None, '0.5', 'low_var_kl', ['a', 'b'], '0.999_1.001']
    """
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "null":
        return None
    if re.fullmatch(r"[+-]?\d+(_\d+)*", text):
        return int(text)
    if re.fullmatch(r"[+-]?(\d+(_\d+)*)?(\.\d*(_\d+)*)?([eE][+-]?\d+)?|[+-]?(inf|nan)", text, re.I) and \
            re.search(r"\d|inf|nan", text, re.I):
        return float(text)
    if text[:1] in "[{":
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    return text


def launch_script_arguments(script: str) -> list[str]:
    """The ``--arguments`` of a slime launch script: the contents of its bash arrays (``NAME=( ... )``) and the
    tokens after ``train.py`` (or ``train_async.py``) on its launch line; comments, ``${ARRAY[@]}`` expansions
    and line continuations dropped.

    >>> launch_script_arguments('A=(\\n --lr 1e-6 # x\\n)\\npython3 train.py ${A[@]} \\\\\\n  --use-tis\\n')
    ['--lr', '1e-6', '--use-tis']
    """
    tokens: list[str] = []
    text = script.replace("\\\n", " ")
    for body in re.findall(r"^\s*\w+=\(\s*(.*?)^\s*\)", text, flags=re.S | re.M):
        tokens += shlex.split(body, comments=True)
    for line in text.splitlines():
        match = re.search(r"\btrain(?:_async)?\.py\b(.*)", line)
        if match:
            tokens += [t for t in shlex.split(match.group(1), comments=True) if not re.fullmatch(r"\$\{\w+\[@\]\}", t)]
    return tokens
