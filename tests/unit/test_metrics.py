import pytest
import torch

from ddp_core.training.metrics import ClassificationMeter, confusion_markdown, log_interval


def test_meter_counts_every_sample_into_the_confusion_matrix():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (50,), generator=generator)
    logits = torch.randn(50, 4, generator=generator)
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    meter = ClassificationMeter(4, torch.device("cpu"))
    for start in range(0, 50, 16):  # uneven last batch
        batch = slice(start, start + 16)
        meter.update(logits[batch], labels[batch], losses[batch].sum())
    result = meter.reduce()  # no process group: a world of one

    predictions = logits.argmax(1)
    expected = torch.zeros(4, 4, dtype=torch.int64)
    for t, p in zip(labels.tolist(), predictions.tolist()):
        expected[t, p] += 1
    assert torch.equal(result.confusion, expected)
    assert result.samples == 50
    assert result.accuracy == (predictions == labels).sum().item() / 50
    for c in range(4):
        mask = labels == c
        assert result.per_class_accuracy[c] == (predictions[mask] == c).double().mean().item()
    assert abs(result.loss - losses.double().mean().item()) < 1e-6  # float32 batch sums


def test_confusion_markdown_names_the_classes():
    table = confusion_markdown(torch.tensor([[3, 1], [0, 4]]), ["cat", "dog"])
    assert "| cat | 3 | 1 |" in table and "| dog | 0 | 4 |" in table


@pytest.mark.parametrize(
    "steps_per_epoch, interval",
    [(1, 1), (5, 1), (10, 1), (24, 2), (195, 19), (1000, 100)],  # 24: CIFAR10 on 8 GPUs at batch 256
)
def test_the_automatic_log_interval_draws_a_curve_at_every_world_size(steps_per_epoch: int, interval: int):
    assert log_interval(steps_per_epoch, 0) == interval
    assert steps_per_epoch // interval >= min(steps_per_epoch, 10)  # points per epoch


def test_an_explicit_log_interval_wins():
    assert log_interval(24, 50) == 50 and log_interval(1000, 3) == 3


@pytest.mark.parametrize("steps_per_epoch, requested", [(0, 0), (10, -1)])
def test_a_log_interval_from_nonsense_is_one_line(steps_per_epoch: int, requested: int):
    with pytest.raises(ValueError, match=r"^log_interval: steps_per_epoch=.*$"):
        log_interval(steps_per_epoch, requested)
