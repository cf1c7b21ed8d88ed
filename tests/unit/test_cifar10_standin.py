"""The offline stand-in for CIFAR10: ``python -m experiments.cifar10_data --write-standin DIR`` writes generated
images that the experiment's own reader loads (with --no-verify: their md5 sums are not the official ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_core.errors import ConfigError
from experiments import cifar10_data as data


def test_the_written_standin_loads_as_cifar10_and_is_refused_by_the_md5_check(tmp_path: Path, capsys):
    assert data.main(["--write-standin", str(tmp_path), "--train-images", "30", "--test-images", "20"]) == 0
    assert "wrote 30 training and 20 test images" in capsys.readouterr().out
    train, test = (
        data.load_split(tmp_path, train=True, verify=False),
        data.load_split(tmp_path, train=False, verify=False),
    )
    assert tuple(train.images.shape) == (30, 32, 32, 3) and tuple(test.images.shape) == (20, 32, 32, 3)
    assert set(train.labels.tolist()) == set(range(data.NUM_CLASSES))  # balanced: every class
    with pytest.raises(ConfigError, match="--no-verify"):  # not the official files
        data.load_split(tmp_path, train=True, verify=True)


def test_a_count_below_one_is_refused(tmp_path: Path):
    with pytest.raises(SystemExit) as exit_info:
        data.main(["--write-standin", str(tmp_path), "--train-images", "0"])
    assert exit_info.value.code == 2
