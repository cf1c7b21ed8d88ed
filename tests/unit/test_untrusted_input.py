"""Untrusted input: nothing in ddp-lab unpickles with weights_only=False or plain pickle.load.

One exception, ``TRUSTED_PICKLES``: the checkpoint writer process unpickles the state its training process sends
it (the process that started it, over a socket in a folder only that user can enter); the training process reads
only JSON back."""

import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*REPO.glob("ddp_core/**/*.py"), *REPO.glob("experiments/**/*.py"), *REPO.glob("bench/**/*.py")]
TRUSTED_PICKLES = {"ddp_core/output/writer_process.py": 1}  # module: its pickle.loads calls


def code_tokens(path: Path) -> list[str]:
    """The file's tokens without strings and comments, so messages that mention the words do not count."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [
        t.string for t in tokens if t.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)
    ]


def test_no_weights_only_false_and_no_plain_pickle_load():
    offenders = []
    for path in SOURCES:
        code, name = " ".join(code_tokens(path)), str(path.relative_to(REPO))
        loads = code.count("pickle . load (") + code.count("pickle . loads (")
        if "weights_only = False" in code or loads != TRUSTED_PICKLES.get(name, 0):
            offenders.append(name)
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
