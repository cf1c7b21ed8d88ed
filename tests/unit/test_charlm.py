"""experiments.charlm's options and data, without a process group: what --text accepts, what spans
several options, and the corpus it generates when no text is given."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ddp_core.config import parse_args
from ddp_core.errors import ConfigError
from experiments import charlm, charlm_data


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot be read as UTF-8 text (No such file or directory)"),
        (b"\xff\xfe\x00binary", "cannot be read as UTF-8 text (UnicodeDecodeError)"),
        ("plain text\n".encode() * 200, None),
        ("ünïcödé ✓\n".encode() * 200, None),
    ],
)
def test_what_text_accepts_is_checked_before_launch_in_one_line(
    tmp_path: Path, content: bytes | None, problem: str | None
):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    args = parse_args(charlm.CharLMArgs, ["--text", str(path), "--block", "16"])  # parsing reads nothing
    if problem is None:
        charlm.main.check(args)
        return
    with pytest.raises(
        ConfigError, match=re.escape(f"--text={str(path)!r} {problem}: name a readable UTF-8 text file")
    ) as refused:
        charlm.main.check(args)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--width", "30", "--heads", "4"], "--width=30 is not a multiple of --heads=4"),
        (["--warmup-steps", "50", "--steps", "40"], "--warmup-steps=50 is longer than --steps=40"),
        (
            ["--text", "{tiny}", "--block", "64"],
            "the text has 500 characters: its held-out tenth must exceed --block=64",
        ),
        (["--stop-at-step", "301"], "--stop-at-step=301 is beyond --steps=300"),
    ],
)
def test_what_spans_several_options_is_refused_before_launch(tmp_path: Path, flags: list[str], message: str):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abcd\n" * 100)
    flags = [flag.format(tiny=tiny) for flag in flags]
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        charlm.main.check(parse_args(charlm.CharLMArgs, flags))
    assert "\n" not in str(refused.value)


def test_the_generated_corpus_is_the_same_everywhere_and_long_enough():
    text = charlm_data.generated_corpus()
    assert text == charlm_data.generated_corpus() and len(text) > 100_000
    assert len(set(text)) < 40  # a small vocabulary: ln(vocabulary) is the untrained loss
    charlm.main.check(parse_args(charlm.CharLMArgs, []))  # the defaults pass


def test_the_contract_model_loads_what_training_builds():
    args = parse_args(charlm.CharLMArgs, ["--block", "16"])
    config = vars(args)
    model = charlm.CONTRACT.model(config)
    chars = torch.zeros(2, 16, dtype=torch.long)
    assert model(chars).shape == (2, 16, len(set(charlm_data.generated_corpus())))
