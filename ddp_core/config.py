"""Configuration: command-line flag > environment variable (real, then ``.env``) > default (docs/configuration.md).

Options are dataclass fields made with ``option(...)``; a bad value is a one-line ConfigError (exit 2) naming the
flag or variable, the value and what it accepts, checked alike for a flag, a variable and a ``.env`` line."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import operator
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from dotenv import load_dotenv

from ddp_core.distributed.group import (
    BACKENDS,
    DEFAULT_INIT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    DistConfig,
    init_method_problem,
)
from ddp_core.errors import ConfigError, alike_on_the_node
from ddp_core.ranks import is_global_rank0, is_local_rank0

A = TypeVar("A")
TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off", ""}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # an integer option without bounds still fits in 64 bits
MAX_TIMEOUT_S = 365 * 24 * 3600.0  # torch's stores and gloo fail (some with a crash) from about 1e13 s
MAX_NPROC = 1024  # processes started on this machine by --nproc
SEED_MIN, SEED_MAX = 0, 2**64 - 1  # the seed option's range (ddp_core/training/seed.py says why)
SEED_RANGE = "0..2**64-1"
SEED_NOTE = "the range torch.manual_seed and numpy's SeedSequence both accept"
PATH_KINDS = ("dir", "output_dir")
GIVEN = "given_options"  # parse_args' record of the options set by a flag or a variable (given_options)


def option(
    default: Any,
    help: str,
    env: str | None = None,
    choices: Sequence[Any] | None = None,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    path: str | None = None,
    check: Callable[[str], str | None] | None = None,
    accepts: str = "",
    note: str = "",
    computation: bool = True,
) -> Any:
    """A dataclass field that is also a command-line flag, and optionally an environment variable. ``minimum``/
    ``maximum`` bound inclusively, ``above``/``below`` exclusively (unbounded: a 64-bit integer, a finite float);
    ``path="dir"`` a directory, ``"output_dir"`` one rank 0 can write; ``check``: value -> problem or None,
    ``accepts`` saying what passes; ``note``: why the range is so, in the error. ``computation=False``: a resumed
    run may change it (``config_changes``)."""
    if path not in (None, *PATH_KINDS):
        raise ValueError(f"path={path!r}: use one of {', '.join(PATH_KINDS)}")
    metadata = {name: value for name, value in locals().items() if name != "default"}  # the arguments by name
    return field(default=default, metadata=metadata)


def options(cls: Any) -> list[dataclasses.Field]:
    """The options of a dataclass (or instance): its fields, a field redeclared with a plain default
    (``log_every: int = 50``) keeping the help and range a base class declared for it."""
    klass = cls if isinstance(cls, type) else type(cls)
    declared: dict[str, Any] = {}
    for base in reversed(klass.__mro__):
        if dataclasses.is_dataclass(base):
            declared.update({f.name: f.metadata for f in dataclasses.fields(base) if f.metadata})
    fields = []
    for f in dataclasses.fields(klass):
        if not f.metadata and f.name in declared:
            f = copy.copy(f)
            f.metadata = declared[f.name]
        fields.append(f)
    return fields


def own(cls: type[A], args: Any) -> A:
    """The options ``cls`` declares, with their values in ``args``: what the part that owns them is handed."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def directory_problem(path: str | Path, writable: bool) -> str | None:
    """Why ``path`` cannot be (or become) a directory, writable by this process if ``writable`` (the kernel's
    answer: ``os.access`` with the effective ids); None if it can. Nothing is created."""
    path = Path(path)
    existing = path
    try:
        while not existing.exists():
            if existing.is_symlink():
                return f"is {'a' if existing == path else 'under a'} broken symbolic link ({existing})"
            if existing.parent == existing:
                break
            existing = existing.parent
        if not existing.is_dir():
            return "is a file, not a directory" if existing == path else f"is under {existing}, which is a file"
    except OSError as error:  # e.g. a parent this user may not search, a name too long
        return f"cannot be checked ({error.strerror or error})"
    except ValueError:  # a NUL byte (only from code: a command line cannot hold one)
        return "is not a valid path"
    if writable and not os.access(existing, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        try:
            read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        what = "is on a read-only file system" if read_only else "is not writable by this user"
        return what if existing == path else f"cannot be created: {existing} {what}"
    return None


def _timeout_option(default: float, help: str, env: str) -> Any:
    return option(
        default, help, env=env, computation=False, above=0, maximum=MAX_TIMEOUT_S, note="seconds; at most 365 days"
    )


@dataclass
class CommonArgs:
    """Options every experiment has."""

    run_dir: str = option(
        "",
        "run directory (default runs/<experiment>/<UTC timestamp>)",
        env="RUN_DIR",
        path="output_dir",
        computation=False,
    )
    seed: int = option(
        0,
        "seed for model init; data order and augmentation derive from it and the global rank",
        env="SEED",
        minimum=SEED_MIN,
        maximum=SEED_MAX,
        note=SEED_NOTE,
    )
    deterministic: bool = option(False, "use deterministic algorithms only (slower on GPU)", env="DETERMINISTIC")
    backend: str = option(
        "auto", "process-group backend: auto is nccl with CUDA, else gloo", env="BACKEND", choices=BACKENDS
    )
    dist_timeout_s: float = _timeout_option(
        DEFAULT_TIMEOUT_S,
        "seconds a collective waits for the other ranks before failing, from the end of the first optimizer step on",
        "DIST_TIMEOUT_S",
    )
    dist_init_timeout_s: float = _timeout_option(
        DEFAULT_INIT_TIMEOUT_S,
        "seconds to wait for the other ranks until the first optimizer step ends "
        "(rendezvous, slow nodes, data, a resume's checkpoint, compilation)",
        "DIST_INIT_TIMEOUT_S",
    )
    init_method: str = option(
        "env://",
        "env://, tcp://HOST:PORT or file:///PATH",
        env="INIT_METHOD",
        check=init_method_problem,
        computation=False,
        accepts="env://, tcp://HOST:PORT (a port in 1-65535) or file:///PATH",
    )
    # The world size a resume may change is checked on its own (ddp_core.output.run), whatever launched it.
    nproc: int = option(
        1,
        "start this many processes with torch.multiprocessing (when not under torchrun)",
        minimum=1,
        maximum=MAX_NPROC,
        computation=False,
    )

    def dist_config(self) -> DistConfig:
        return DistConfig(
            backend=self.backend,
            timeout_s=self.dist_timeout_s,
            init_method=self.init_method,
            init_timeout_s=self.dist_init_timeout_s,
        )


def _bound_text(value: float) -> str:
    """A bound as a reader wants it: 2**64-1 rather than 18446744073709551615."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and abs(value) >= 2**16:
        for offset, suffix in ((0, ""), (1, "-1")):
            bits = (abs(value) + offset).bit_length() - 1
            if abs(value) + offset == 2**bits:
                return f"{'-' if value < 0 else ''}2**{bits}{suffix}"
    return str(value)


def _interval(meta: dict[str, Any], integer: bool) -> str:
    lower = (meta["above"], ">") if meta.get("above") is not None else (meta.get("minimum"), ">=")
    upper = (meta["below"], "<") if meta.get("below") is not None else (meta.get("maximum"), "<=")
    if integer:
        lo = INT64_MIN if lower[0] is None else lower[0] + (1 if lower[1] == ">" else 0)
        hi = INT64_MAX if upper[0] is None else upper[0] - (1 if upper[1] == "<" else 0)
        return f"an integer in {_bound_text(lo)}..{_bound_text(hi)}"
    if lower[0] is not None and upper[0] is not None:
        left, right = "(" if lower[1] == ">" else "[", ")" if upper[1] == "<" else "]"
        return f"a number in {left}{_bound_text(lower[0])}, {_bound_text(upper[0])}{right}"
    bound = lower if lower[0] is not None else upper
    return "a finite number" + (f" {bound[1]} {_bound_text(bound[0])}" if bound[0] is not None else "")


def accepted(kind: type, meta: dict[str, Any], with_note: bool = True) -> str:
    """What an option accepts, in words: 'an integer in 0..2**64-1', 'a finite number > 0', 'one of ...'."""
    if meta.get("accepts"):
        text = meta["accepts"]
    elif meta.get("choices"):
        text = "one of " + ", ".join(map(str, meta["choices"]))
    elif kind is bool:
        text = "a boolean: 1, true, yes, on or 0, false, no, off"
    elif kind in (int, float):
        text = _interval(meta, integer=kind is int)
    elif meta.get("path") == "output_dir":
        text = "a directory path that rank 0 can create or write into"
    elif meta.get("path") == "dir":
        text = "a directory path"
    else:
        text = "a non-empty string"
    return text + (f" ({meta['note']})" if with_note and meta.get("note") else "")


SHOWN_CHARACTERS = 400  # whole paths (a user must see which one), but not a pasted blob


def _show(raw: str, quote: bool = True) -> str:
    """The value as typed, on one line: bare when it is a plain token (``-5``, ``inf``), else quoted."""
    text = raw if len(raw) <= SHOWN_CHARACTERS else raw[:SHOWN_CHARACTERS] + "..."
    plain = re.fullmatch(r"[\w.+-]+", raw, flags=re.ASCII) is not None
    return text if plain and not quote else repr(text)


def _in_bounds(value: float, meta: dict[str, Any]) -> bool:
    checks = (("minimum", operator.ge), ("maximum", operator.le), ("above", operator.gt), ("below", operator.lt))
    return all(meta.get(key) is None or test(value, meta[key]) for key, test in checks)


def convert(
    raw: str, kind: type, meta: dict[str, Any], name: str, default: Any = None, check_paths: bool = True
) -> Any:
    """``raw`` (a flag's or a variable's text) as ``kind`` and in range, else ConfigError ``NAME=VALUE <what is
    wrong>: it must be <what it accepts>``. Paths are looked at on this machine unless ``check_paths`` is false."""

    def refuse(problem: str, quote: bool = True) -> typing.NoReturn:
        raise ConfigError(f"{name}={_show(raw, quote)} {problem}: it must be {accepted(kind, meta)}")

    if kind is bool:
        word = raw.strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            refuse("is not a boolean")
        return word in TRUE_WORDS
    if kind is int:
        try:
            value = int(raw)
        except ValueError:  # also a number of more than 4300 digits
            refuse("is not an integer")
        lo = meta["minimum"] if meta.get("minimum") is not None else INT64_MIN
        hi = meta["maximum"] if meta.get("maximum") is not None else INT64_MAX
        if not (lo <= value <= hi and _in_bounds(value, meta)):
            refuse("is out of range", quote=False)
        return value
    if kind is float:
        try:
            value = float(raw)
        except ValueError:
            refuse("is not a number")
        if not math.isfinite(value):  # nan, inf, and numbers too large for a float (1e400)
            refuse("is not finite", quote=False)
        if not _in_bounds(value, meta):
            refuse("is out of range", quote=False)
        return value
    choices = meta.get("choices")
    if choices and raw not in choices:
        raise ConfigError(f"{name}={_show(raw)} is not one of {', '.join(map(str, choices))}")
    if raw == "" and default != "":
        refuse("is empty")
    if raw and meta.get("path") and check_paths:
        problem = directory_problem(raw, writable=meta["path"] == "output_dir" and is_global_rank0())
        if problem:
            refuse(problem)
    if raw and meta.get("check"):
        problem = meta["check"](raw)
        if problem:
            refuse(problem)
    return raw


def plain_type(kind: Any) -> type:
    """``X | None`` -> ``X``: a None default means "decide at run time" (e.g. --amp: on with CUDA)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 else kind


def _hints(cls: type) -> dict[str, type]:
    return {name: plain_type(kind) for name, kind in typing.get_type_hints(cls).items()}


def _attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--lr -1e3`` -> ``--lr=-1e3``, so the value gets the usual message with the range (argparse takes ``-1e3``
    for an option); a following option (``--run-dir --seed 3``) is left alone."""
    valued = [a for a in parser._actions if a.nargs is None and not isinstance(a, argparse.BooleanOptionalAction)]
    takes_value = {flag for action in valued for flag in action.option_strings}
    known = set(parser._option_string_actions)
    out: list[str] = []
    i = 0
    while i < len(argv):
        token, following = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        if token == "--":
            return out + argv[i:]
        dash_value = token in takes_value and following.startswith("-") and not following.startswith("--")
        if dash_value and following not in known:
            out.append(f"{token}={following}")
            i += 2
        else:
            out.append(token)
            i += 1
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see --help)")

    def print_help(self, file: typing.IO[str] | None = None) -> None:
        if is_local_rank0():  # every process of the node was asked: the help once (each exits 0)
            super().print_help(file)


@functools.cache
def _parser(cls: type, prog: str | None, description: str | None) -> tuple[_Parser, dict[str, type]]:
    """``cls``'s parser and its fields' plain types, built once per process (5-20 ms a build)."""
    hints = _hints(cls)
    parser = _Parser(prog=prog, description=description, allow_abbrev=False)
    for f in options(cls):
        kind, meta = hints[f.name], f.metadata
        flag = "--" + f.name.replace("_", "-")
        details = [f"default {f.default!r}"] if f.default != "" else []
        details += [f"env {meta['env']}"] if meta.get("env") else []
        if kind in (int, float):
            details.append(accepted(kind, meta, with_note=False))
        help_text = (meta.get("help", "") + (f" ({'; '.join(details)})" if details else "")).replace("%", "%%")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:  # converted and checked below, with the same messages as a variable's value
            choices = meta.get("choices")
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else kind.__name__.upper()
            parser.add_argument(flag, type=str, default=None, help=help_text, metavar=metavar)
    return parser, hints


@alike_on_the_node()  # the same flags, variables and files on every process of a node: a bad value's line once there
def parse_args(cls: type[A], argv: Sequence[str] | None = None, description: str | None = None) -> A:
    """Build ``cls`` from flags, then environment variables, then defaults. Loads ``./.env`` first."""
    load_dotenv(Path.cwd() / ".env", override=False)  # the real environment wins over .env
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m NAME` / `torchrun -m NAME`
    # a package's __main__ (python -m tools.preflight) by the name it was run as
    prog = f"python -m {main_spec.name.removesuffix('.__main__')}" if main_spec and main_spec.name else None
    parser, hints = _parser(cls, prog, description)
    namespace = parser.parse_args(_attach_dash_values(parser, sys.argv[1:] if argv is None else list(argv)))

    values, given = {}, {}
    for f in options(cls):
        kind, raw = hints[f.name], getattr(namespace, f.name)
        env_name, flag = f.metadata.get("env"), "--" + f.name.replace("_", "-")
        if isinstance(raw, str):
            value = convert(raw, kind, f.metadata, flag, f.default)
        elif raw is None and env_name and os.environ.get(env_name, "").strip() != "":  # empty: as if unset
            value = convert(os.environ[env_name], kind, f.metadata, env_name, f.default)
        else:
            value = raw  # a boolean flag, or nothing
        if value is not None:
            given[f.name] = flag if raw is not None else env_name
        values[f.name] = f.default if value is None else value
    try:
        args = cls(**values)  # a __post_init__ may check more (e.g. that --resume-from loads)
        object.__setattr__(args, GIVEN, given)  # not a field: asdict (the manifest's config) leaves it out
        return args
    except ConfigError as error:  # one line, whatever a value held (a path with a newline in it)
        if "\n" in (text := str(error)) or "\r" in text:
            raise ConfigError(text.replace("\r", "\\r").replace("\n", "\\n")) from None
        raise


def given_options(args: Any) -> dict[str, str] | None:
    """The options of ``args`` that its command line or environment set (``parse_args``), each with how: its flag
    (``--steps``) or its variable (``SEED``); None for arguments built in code, which set every option."""
    return getattr(args, GIVEN, None)


def options_from_environment(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """``{field name: value}`` of the variables of ``cls``'s options that ``environ`` sets, checked (paths not
    looked at): a launcher refuses a bad SEED once, before torchrun starts."""
    hints, values = _hints(cls), {}
    for f in options(cls):
        env_name = f.metadata.get("env")
        if env_name and environ.get(env_name, "").strip() != "":
            values[f.name] = convert(
                environ[env_name], hints[f.name], f.metadata, env_name, f.default, check_paths=False
            )
    return values


def config_changes(written: dict[str, Any], args: Any) -> list[str]:
    """``--name: old -> new`` for each option that can change the computation whose value in ``args`` differs from
    ``written`` (a checkpoint's config, which may not know newer options); ``VARIABLE: old -> new`` where the
    environment set it."""
    changes, given = [], given_options(args) or {}
    for f in options(args):
        if f.metadata.get("computation", True) and f.name in written and written[f.name] != getattr(args, f.name):
            name = given.get(f.name) or "--" + f.name.replace("_", "-")
            changes.append(f"{name}: {written[f.name]!r} -> {getattr(args, f.name)!r}")
    return changes


def check_values(args: Any) -> None:
    """The declared ranges of ``args``'s options, for arguments built in code, with a flag's messages
    (``str(value)`` is exact for ints and floats)."""
    hints = _hints(type(args))
    for f in options(args):
        value, kind = getattr(args, f.name), hints[f.name]
        if kind is bool or not (isinstance(value, (int, float)) or (isinstance(value, str) and value != f.default)):
            continue  # None, or a default string (e.g. the run directory ""): the code's own choice
        convert(str(value), kind, f.metadata, "--" + f.name.replace("_", "-"), f.default)


def require(condition: bool, message: str) -> None:
    """A ConfigError unless ``condition`` holds; for range checks on experiment options."""
    if not condition:
        raise ConfigError(message)
