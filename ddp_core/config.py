"""Configuration: command-line flag > environment variable (real, then ``.env``) > default.

An experiment declares its options as a dataclass whose fields are made with ``option(...)``; the
command line is generated from it. Unknown flags and unparsable values are ConfigErrors (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TypeVar

from dotenv import load_dotenv

from ddp_core.dist import BACKENDS, DEFAULT_TIMEOUT_S, DistConfig
from ddp_core.errors import ConfigError

A = TypeVar("A")
TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off", ""}


def option(default: Any, help: str, env: str | None = None, choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field that is also a command-line flag, and optionally an environment variable."""
    return field(default=default, metadata={"help": help, "env": env, "choices": choices})


@dataclass
class CommonArgs:
    """Options every experiment has."""

    run_dir: str = option("", "run directory (default runs/<experiment>/<UTC timestamp>)", env="RUN_DIR")
    seed: int = option(0, "seed for model init; data order and augmentation derive from it and the global rank", env="SEED")
    deterministic: bool = option(False, "use deterministic algorithms only (slower on GPU)", env="DETERMINISTIC")
    backend: str = option("auto", "process-group backend: auto is nccl with CUDA, else gloo", env="BACKEND", choices=BACKENDS)
    dist_timeout_s: float = option(DEFAULT_TIMEOUT_S, "seconds to wait for other ranks before failing", env="DIST_TIMEOUT_S")
    init_method: str = option("env://", "env://, tcp://HOST:PORT or file:///PATH", env="INIT_METHOD")
    nproc: int = option(1, "start this many processes with torch.multiprocessing (when not under torchrun)")

    def dist_config(self) -> DistConfig:
        return DistConfig(backend=self.backend, timeout_s=self.dist_timeout_s, init_method=self.init_method)


def _convert(raw: str, kind: type, name: str) -> Any:
    if kind is bool:
        word = raw.strip().lower()
        if word in TRUE_WORDS | FALSE_WORDS:
            return word in TRUE_WORDS
        raise ConfigError(f"{name}={raw!r} is not a boolean: use 1 or 0")
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def _plain_type(kind: Any) -> type:
    """``X | None`` -> ``X``: a None default means "decide at run time" (e.g. --amp: on with CUDA)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 else kind


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see --help)")


def parse_args(cls: type[A], argv: Sequence[str] | None = None, description: str | None = None) -> A:
    """Build ``cls`` from flags, then environment variables, then defaults. Loads ``./.env`` first."""
    load_dotenv(Path.cwd() / ".env", override=False)  # the real environment wins over .env
    hints = {name: _plain_type(kind) for name, kind in typing.get_type_hints(cls).items()}
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m NAME` / `torchrun -m NAME`
    prog = f"python -m {main_spec.name}" if main_spec and main_spec.name else None
    parser = _Parser(prog=prog, description=description, allow_abbrev=False)
    for f in dataclasses.fields(cls):
        kind, meta = hints[f.name], f.metadata
        flag = "--" + f.name.replace("_", "-")
        details = ([f"default {f.default!r}"] if f.default != "" else []) + ([f"env {meta['env']}"] if meta.get("env") else [])
        help_text = meta.get("help", "") + (f" ({'; '.join(details)})" if details else "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=None, choices=meta.get("choices"), help=help_text, metavar=kind.__name__.upper())
    namespace = parser.parse_args(argv)

    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(namespace, f.name)
        env_name = f.metadata.get("env")
        if value is None and env_name and os.environ.get(env_name, "").strip() != "":
            value = _convert(os.environ[env_name], hints[f.name], env_name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"{env_name}={value!r} is not one of {', '.join(map(str, choices))}")
        values[f.name] = f.default if value is None else value
    return cls(**values)


def require(condition: bool, message: str) -> None:
    """A ConfigError unless ``condition`` holds; for range checks on experiment options."""
    if not condition:
        raise ConfigError(message)
