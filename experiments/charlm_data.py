"""The character-level language model's text: a file, or a corpus generated from a small grammar; its split."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

HELD_OUT = 0.1  # the last tenth of the text


def generated_corpus(sentences: int = 3000) -> str:
    """English-like sentences from a fixed grammar and seed: the same text everywhere, learnable in minutes."""
    pick = random.Random(1234).choice
    nouns = "sailor fox river garden teacher engine window market storm child letter mountain".split()
    verbs = "sees finds carries follows paints remembers builds answers crosses opens".split()
    adjectives = "old quiet small bright heavy careful distant green sudden gentle".split()
    places = "near the harbour|under the bridge|before dawn|in the valley|after the rain|beside the road".split("|")
    lines = [
        f"the {pick(adjectives)} {pick(nouns)} {pick(verbs)} a {pick(adjectives)} {pick(nouns)} {pick(places)}."
        for _ in range(sentences)
    ]
    return "\n".join(lines) + "\n"


def read_text(path: str) -> str:
    return Path(path).read_text(encoding="utf-8") if path else generated_corpus()


@dataclass
class Corpus:
    """The text as character indices: the first 90% trains, the rest is held out."""

    vocab: list[str]
    index: dict[str, int]
    train: torch.Tensor
    held_out: torch.Tensor

    @classmethod
    def of(cls, text: str) -> Corpus:
        vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(vocab)}
        encoded = torch.tensor([index[c] for c in text], dtype=torch.long)
        split = len(encoded) - int(len(encoded) * HELD_OUT)
        return cls(vocab, index, encoded[:split], encoded[split:])
