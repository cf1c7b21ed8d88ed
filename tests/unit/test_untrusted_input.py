"""Untrusted input: nothing in ddp-lab unpickles with weights_only=False or plain pickle.load."""

import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*REPO.glob("ddp_core/**/*.py"), *REPO.glob("experiments/**/*.py"), *REPO.glob("bench/**/*.py")]


def code_tokens(path: Path) -> list[str]:
    """The file's tokens without strings and comments, so messages that mention the words do not count."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [
        t.string for t in tokens if t.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)
    ]


def test_no_weights_only_false_and_no_plain_pickle_load():
    offenders = []
    for path in SOURCES:
        code = " ".join(code_tokens(path))
        if "weights_only = False" in code or "pickle . load (" in code or "pickle . loads (" in code:
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == [], offenders


def test_the_check_sees_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import torch\nx = torch.load("f", weights_only=False)  # "weights_only=True"\n')
    assert "weights_only = False" in " ".join(code_tokens(sample))


def test_every_torch_load_passes_weights_only_true():
    for path in SOURCES:
        code = " ".join(code_tokens(path))
        for call in code.split("torch . load (")[1:]:
            arguments = call.split(")")[0]
            assert "weights_only = True" in arguments, f"{path.relative_to(REPO)}: torch.load({arguments})"
