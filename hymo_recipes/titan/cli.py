"""The command line before and around TorchTitan's parser (tyro), for train.parse_config.

- ``bool_flags``: a boolean written with a value, ``--checkpoint.last_save_model_only=false``
  or ``--checkpoint.last_save_model_only false`` (true/false, yes/no, on/off, 1/0), becomes
  tyro's ``--checkpoint.no-last_save_model_only``; tyro itself takes only the bare flag and its
  ``no-`` form.
- ``one_line_errors``: tyro reports a bad command line (an unknown flag, a value of the wrong
  type, a choice not offered) in a framed box and exits 2; here that box becomes a ValueError
  of one line, which parse_config reports like every other config error. ``--help`` (exit 0)
  prints as tyro wrote it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import sys
import typing

TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
HELP = "python -m hymo_recipes.train --help lists every option"


def bool_fields(config_cls) -> set[str]:
    """``section.field`` of every bool field of the (merged) JobConfig class."""
    out = set()
    for section in dataclasses.fields(config_cls):
        cls = section.type if isinstance(section.type, type) else None
        if cls is None:
            cls = typing.get_type_hints(config_cls).get(section.name)
        if not dataclasses.is_dataclass(cls):
            continue
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an annotation this Python cannot resolve: not a bool here
            continue
        out |= {f"{section.name}.{f.name}" for f in dataclasses.fields(cls) if hints.get(f.name) is bool}
    return out


def bool_flags(args: list[str], config_cls) -> list[str]:
    """``args`` with every boolean written with a value turned into tyro's form (module doc)."""
    bools = bool_fields(config_cls)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.partition("=")
        name = key[2:].replace("-", "_") if key.startswith("--") else None
        if name in bools:
            if not eq and i + 1 < len(args) and args[i + 1].lower() in TRUE + FALSE:
                value, eq = args[i + 1], "="
                i += 1
            if eq:
                if value.lower() not in TRUE + FALSE:
                    raise ValueError(f"{key} takes true or false (or write {key} / "
                                     f"--{name.replace('.', '.no-', 1)}), got {value!r}")
                section, _, field = name.partition(".")
                key = f"--{section}.{field}" if value.lower() in TRUE else f"--{section}.no-{field}"
            out.append(key)
        else:
            out.append(arg)
        i += 1
    return out


_FRAME = re.compile(r"[\u2500-\u257f]+")


def box_to_line(text: str) -> str:
    """The message of tyro's error report, one line. On a terminal it is a box (title in the top
    border, the message, a rule, the option's help text); otherwise the title, a rule, the
    message, a rule, the rest. The message is the text between the title and the next rule."""
    segments: list[list[str]] = [[]]
    for raw in text.splitlines():
        line = _FRAME.sub(" ", raw).strip(" |")
        if re.fullmatch(r"\s*-{3,}\s*", line) or (not line.strip() and raw.strip()):
            segments.append([])  # a rule
        elif line.strip():
            segments[-1].append(line.strip())
    segments = [seg for seg in segments if seg] or [["the command line was not understood"]]
    title, *message = segments[0]
    if not message and len(segments) > 1:
        message = segments[1]
    return f"{' '.join(message) or title} ({HELP})"


@contextlib.contextmanager
def one_line_errors():
    """Runs tyro with its output held back: on an error exit, raises ValueError with the box's
    message in one line; otherwise (``--help``, or no exit) passes its output through."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    except SystemExit as e:
        if e.code not in (0, None):
            raise ValueError(box_to_line(err.getvalue() or out.getvalue())) from None
        sys.stdout.write(out.getvalue())
        sys.stderr.write(err.getvalue())
        raise
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
