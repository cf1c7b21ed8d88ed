"""Exact classification metrics across ranks: a confusion matrix and a loss sum, each reduced once (with
``EvalSampler`` every sample sits on exactly one rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_core.training.samplers import global_sum_count


@dataclass
class ClassificationResult:
    confusion: torch.Tensor  # [true class, predicted class] counts, on CPU
    loss: float  # mean over every evaluated sample

    @property
    def samples(self) -> int:
        return int(self.confusion.sum())

    @property
    def accuracy(self) -> float:
        return float(self.confusion.diag().sum()) / max(1, self.samples)

    def as_metrics(self) -> dict[str, float]:
        """What an evaluation reports to the run: ``eval/accuracy``, ``eval/loss``, ``eval/samples``."""
        return {"accuracy": self.accuracy, "loss": self.loss, "samples": self.samples}

    @property
    def per_class_accuracy(self) -> list[float]:
        per_class = self.confusion.sum(dim=1).clamp(min=1)
        return (self.confusion.diag().double() / per_class.double()).tolist()


class ClassificationMeter:
    """Accumulate on this rank (on the data's device, no sync per batch); ``reduce`` sums over all ranks."""

    def __init__(self, num_classes: int, device: torch.device):
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """``loss_sum``: the batch's summed (not averaged) loss."""
        predictions = logits.argmax(dim=1)
        flat = labels * self.num_classes + predictions
        self.confusion += torch.bincount(flat, minlength=self.num_classes**2).view(self.num_classes, self.num_classes)
        self.loss_sum += loss_sum.detach().double()

    def reduce(self) -> ClassificationResult:
        confusion = self.confusion.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(confusion)
        total, count = global_sum_count(self.loss_sum, int(self.confusion.sum()))
        return ClassificationResult(confusion=confusion.cpu(), loss=total / max(1, count))


def confusion_markdown(confusion: torch.Tensor, class_names: list[str]) -> str:
    """The confusion matrix as a markdown table (TensorBoard's text tab), rows true, columns predicted."""
    header = "| true \\ predicted | " + " | ".join(class_names) + " |"
    rule = "|---" * (len(class_names) + 1) + "|"
    rows = [f"| {name} | " + " | ".join(str(int(v)) for v in row) + " |" for name, row in zip(class_names, confusion)]
    return "\n".join([header, rule, *rows])


def log_interval(steps_per_epoch: int, requested: int, points_per_epoch: int = 10) -> int:
    """Optimizer steps between training-curve points: ``requested``, or with 0 about ``points_per_epoch`` an epoch
    (docs/decisions.md, "CIFAR10")."""
    if steps_per_epoch < 1 or requested < 0:
        raise ValueError(f"log_interval: steps_per_epoch={steps_per_epoch} must be >= 1 and requested={requested} >= 0")
    return requested or max(1, steps_per_epoch // points_per_epoch)
