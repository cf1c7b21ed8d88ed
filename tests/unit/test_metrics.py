import torch

from ddp_core.training.metrics import ClassificationMeter, confusion_image, confusion_markdown


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


def test_confusion_renderings():
    confusion = torch.tensor([[3, 1], [0, 4]])
    image = confusion_image(confusion, cell=2)
    assert image.shape == (3, 4, 4) and image.min() >= 0 and image.max() <= 1
    assert image[0, 0, 0] < image[0, 0, 2]  # the larger share (3 of 4) is darker than the smaller (1 of 4)
    table = confusion_markdown(confusion, ["cat", "dog"])
    assert "| cat | 3 | 1 |" in table and "| dog | 0 | 4 |" in table
