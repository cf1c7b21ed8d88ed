"""The Pillow figures TensorBoard shows: the labelled confusion matrix and the captioned predictions."""

import pytest
import torch

from ddp_core.output.figures import MAX_SIDE, confusion_figure, prediction_grid

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def red_pixels(image: torch.Tensor) -> int:
    r, g, b = image.int()
    return int(((r > 150) & (g < 60) & (b < 60)).sum())


@pytest.mark.parametrize("k", [1, 2, 10, 100])
def test_a_confusion_figure_of_any_size_is_a_chw_uint8_image(k: int):
    confusion = torch.randint(0, 50, (k, k), generator=torch.Generator().manual_seed(k))
    image = confusion_figure(confusion, [f"class {i}" for i in range(k)])
    assert image.dtype == torch.uint8 and image.ndim == 3 and image.shape[0] == 3
    assert 50 < image.shape[1] < MAX_SIDE + 400 and 50 < image.shape[2] < MAX_SIDE + 400


def test_ten_classes_get_room_for_their_names_and_counts():
    image = confusion_figure(torch.full((10, 10), 1000), CLASSES)
    assert image.shape[1] >= 10 * 28 and image.shape[2] >= 10 * 28  # the old unlabeled image was 160 x 160


def test_the_counts_are_drawn_not_only_the_colours():
    # The same shares of each row (so the same colours), total and accuracy; only the numbers differ.
    a = confusion_figure(torch.tensor([[1, 1], [3, 3]]), ["cat", "dog"])
    b = confusion_figure(torch.tensor([[3, 3], [1, 1]]), ["cat", "dog"])
    assert a.shape == b.shape and not torch.equal(a, b)


def test_different_counts_give_different_pixels():
    a = confusion_figure(torch.tensor([[9, 1], [2, 7]]), ["cat", "dog"])
    b = confusion_figure(torch.tensor([[1, 9], [2, 7]]), ["cat", "dog"])
    assert a.shape == b.shape and not torch.equal(a, b)


def test_the_class_names_are_drawn():
    a = confusion_figure(torch.tensor([[9, 1], [2, 7]]), ["cat", "dog"])
    b = confusion_figure(torch.tensor([[9, 1], [2, 7]]), ["dog", "cat"])
    assert a.shape == b.shape and not torch.equal(a, b)


def test_long_and_unusual_class_names_do_not_crash_or_widen_without_bound():
    image = confusion_figure(torch.eye(3, dtype=torch.int64), ["x" * 500, "", "Hündin 🐕 猫"])
    assert image.shape[1] < 600 and image.shape[2] < 600


def test_an_empty_row_and_float_counts_are_fine():
    confusion_figure(torch.tensor([[0.0, 0.0], [1.0, 3.0]]), ["a", "b"])


@pytest.mark.parametrize(
    "confusion, names, message",
    [
        (torch.zeros(2, 3), ["a", "b"], r"must be square \(classes x classes\), got shape \(2, 3\)"),
        (torch.zeros(4), list("abcd"), r"must be square .* got shape \(4,\)"),
        (torch.zeros(0, 0), [], "empty"),
        (torch.zeros(2, 2), ["a"], "2 x 2 confusion matrix but 1 class names"),
        (torch.tensor([[1, -1], [0, 0]]), ["a", "b"], "negative or non-finite"),
        (torch.tensor([[1.0, float("nan")], [0, 0]]), ["a", "b"], "negative or non-finite"),
        ([[1, 0], [0, 1]], ["a", "b"], "expected a torch.Tensor, got list"),
    ],
)
def test_a_bad_confusion_matrix_is_a_one_line_error(confusion, names, message: str):
    with pytest.raises(ValueError, match=message) as error:
        confusion_figure(confusion, names)
    assert "\n" not in str(error.value)


def grey(n: int) -> torch.Tensor:
    return torch.full((n, 3, 32, 32), 0.5)


def test_a_prediction_grid_is_a_chw_uint8_image_with_room_for_its_captions():
    labels = torch.arange(32) % 10
    image = prediction_grid(grey(32), labels, labels, CLASSES)
    assert image.dtype == torch.uint8 and image.shape[0] == 3
    assert image.shape[1] > 4 * 64 and image.shape[2] > 8 * 64  # 4 rows of 8, each enlarged to 64 pixels


def test_wrong_predictions_are_marked_in_red():
    labels = torch.arange(8)
    assert red_pixels(prediction_grid(grey(8), labels, labels, CLASSES)) == 0
    one_wrong = prediction_grid(grey(8), labels.where(labels != 3, torch.tensor(4)), labels, CLASSES)
    assert red_pixels(one_wrong) > 100  # its frame and its caption


def test_the_predicted_class_is_drawn():
    labels = torch.zeros(2, dtype=torch.int64)
    a = prediction_grid(grey(2), torch.tensor([0, 1]), labels, CLASSES)
    b = prediction_grid(grey(2), torch.tensor([0, 2]), labels, CLASSES)
    assert a.shape == b.shape and not torch.equal(a, b)


def test_uint8_and_grey_pictures_and_long_names_are_fine():
    pictures = torch.randint(0, 256, (3, 1, 20, 20), dtype=torch.uint8)
    image = prediction_grid(pictures, torch.tensor([0, 1, 0]), torch.tensor([1, 1, 0]), ["x" * 300, "y"], columns=2)
    assert image.dtype == torch.uint8 and image.shape[2] < 800


@pytest.mark.parametrize(
    "pictures, predicted, true, message",
    [
        (
            torch.zeros(2, 32, 32),
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            r"\(N, 3 or 1, H, W\) tensor, got \(2, 32, 32\)",
        ),
        (
            torch.zeros(0, 3, 8, 8),
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
            "nothing to draw",
        ),
        (
            grey(2),
            torch.zeros(3, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            r"predicted labels: expected one per picture, shape \(2,\), got \(3,\)",
        ),
        (
            grey(2),
            torch.zeros(2, dtype=torch.int64),
            torch.tensor([0, 10]),
            "true labels range 0..10, but there are 10 class names",
        ),
        (grey(2), torch.tensor([-1, 0]), torch.zeros(2, dtype=torch.int64), "predicted labels range -1..0"),
    ],
)
def test_bad_predictions_are_a_one_line_error(pictures, predicted, true, message: str):
    with pytest.raises(ValueError, match=message) as error:
        prediction_grid(pictures, predicted, true, CLASSES)
    assert "\n" not in str(error.value)
