"""A character-level causal transformer language model: the run object on a second domain (no batch norm).

Launch (every command from the repository root):

    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.charlm   # 2 GPUs, or 2 CPU processes
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.charlm --text my_book.txt  # any UTF-8
    python -m experiments.charlm --nproc 2 --steps 300                                # no torchrun

    # stop at step 120 (a checkpoint), then continue it (same number of processes)
    export RUN_DIR=runs/charlm/try1
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.charlm --stop-at-step 120
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.charlm --resume

Without --text: a corpus generated from a small grammar (nothing is downloaded). The first 90% of the text
trains, each rank drawing random windows from its own checkpointed stream (a resume continues exactly).
``eval_loss``: the mean cross-entropy in nats per character over every held-out character (counted once at
any world size); an untrained model scores about ln(vocabulary size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ddp_core.config import option, require
from ddp_core.contract_spec import ContractSpec
from ddp_core.distributed.group import unwrap
from ddp_core.errors import ConfigError
from ddp_core.experiment import StepsArgs, TrainingArgs, TrainingRun, experiment_main
from ddp_core.output.logging import RankZeroWriter
from ddp_core.ranks import on_rank0
from ddp_core.training.optim import fused_on, weight_decay_groups
from ddp_core.training.samplers import EvalSampler, global_sum_count
from ddp_core.training.schedules import lr_at, set_lr
from experiments.charlm_data import HELD_OUT, Corpus, read_text


@dataclass
class CharLMArgs(StepsArgs, TrainingArgs):
    text: str = option("", "UTF-8 text file to learn (default: a corpus generated from a small grammar)")
    batch_size: int = option(16, "windows per process per step", minimum=1, maximum=4096)
    block: int = option(64, "characters of context per window", minimum=2, maximum=4096)
    layers: int = option(2, "transformer layers", minimum=1, maximum=64)
    width: int = option(64, "model width (a multiple of --heads)", minimum=1, maximum=8192)
    heads: int = option(4, "attention heads", minimum=1, maximum=128)
    lr: float = option(3e-3, "peak AdamW learning rate", above=0)
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)", minimum=0)
    warmup_steps: int = option(30, "linear warm-up steps before the cosine decay (at most --steps)", minimum=0)
    grad_clip: float = option(1.0, "clip the gradients' global norm to this (0: off)", minimum=0)
    checkpoint_every: int = 100  # the shared options' own defaults for this experiment
    eval_every: int = 100
    log_every: int = 20


class CharLM(nn.Module):
    """Token and position embeddings, pre-norm causal transformer layers, a linear head."""

    def __init__(self, vocab: int, block: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(block, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        length = chars.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=chars.device)
        hidden = self.token(chars) + self.position(torch.arange(length, device=chars.device))
        return self.head(self.norm(self.layers(hidden, mask=mask, is_causal=True)))


def build_model(config: dict, vocab: int) -> CharLM:
    return CharLM(vocab, config["block"], config["width"], config["layers"], config["heads"])


CONTRACT = ContractSpec(
    model=lambda config: build_model(config, len(set(read_text(config["text"])))),
    brief=tuple("--steps 12 --warmup-steps 3 --checkpoint-every 4 --eval-every 6 --log-every 4 --block 16".split()),
    stop_at_step=5,
    long=tuple("--steps 1000000 --checkpoint-every 5 --block 16".split()),
    world_size_invariant=False,  # every rank draws its own windows
)


def validate(args: CharLMArgs) -> None:
    require(args.width % args.heads == 0, f"--width={args.width} is not a multiple of --heads={args.heads}")
    require(args.warmup_steps <= args.steps, f"--warmup-steps={args.warmup_steps} is longer than --steps={args.steps}")
    try:  # read once here, before any process starts: a bad file is one line, not a traceback per rank
        size = len(read_text(args.text))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"--text={args.text!r} cannot be read as UTF-8 text "
            f"({getattr(error, 'strerror', None) or type(error).__name__}): name a readable UTF-8 text file"
        ) from None
    problem = f"the text has {size} characters: its held-out tenth must exceed --block={args.block} (a longer --text?)"
    require(int(size * HELD_OUT) > args.block, problem)


def train(run: TrainingRun, args: CharLMArgs) -> dict[str, float]:
    text = read_text(args.text)
    corpus = Corpus.of(text)
    vocab, train_part, held_out = corpus.vocab, corpus.train, corpus.held_out
    model = run.wrap(build_model(vars(args), len(vocab)))
    optimizer = torch.optim.AdamW(weight_decay_groups(model, args.weight_decay), lr=args.lr, **fused_on(run.device))
    loss_fn, summed_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")

    def sample_batch() -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's random windows, drawn from the global RNG the run seeds per rank and checkpoints."""
        starts = torch.randint(len(train_part) - args.block, (args.batch_size,))
        windows = torch.stack([train_part[s : s + args.block + 1] for s in starts.tolist()]).to(run.device)
        return windows[:, :-1], windows[:, 1:]

    # Held-out windows side by side (the first of each predicts from less context); every character once.
    mine = [i * args.block for i in EvalSampler((len(held_out) - 1) // args.block, run.rank, run.world_size)]

    @torch.no_grad()
    def evaluate(step: int, writer: RankZeroWriter) -> dict[str, float]:
        net = unwrap(model).eval()  # ranks hold different counts: no DDP collective inside forward
        loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
        for first in range(0, len(mine), 64):
            chunk = torch.stack([held_out[s : s + args.block + 1] for s in mine[first : first + 64]]).to(run.device)
            loss_sum += summed_loss(net(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten()).double()
        sample = on_rank0(lambda: generate(net, vocab, corpus.index, run.device, args.block))  # rank 0's sample
        if sample is not None:
            writer.add_text("eval/sample", sample, step)
        net.train()
        total, count = global_sum_count(loss_sum, len(mine) * args.block)
        return {"loss": total / count}

    plan = run.plan(total_steps=args.steps, batch_size=args.batch_size, evaluate=evaluate)  # in steps: no epochs
    loop = plan.resume_or_start(model, optimizer)  # a checkpoint's state, or fresh per-rank streams
    optimizer = loop.optimizer  # under --zero: the sharded one
    about = f"{len(text)} characters, vocabulary {len(vocab)} (ln {math.log(len(vocab)):.3f}), {len(held_out)} held out"
    loop.writer.add_text("data", about, 0)

    for micro_batches in loop.steps(iter(sample_batch, None)):  # --steps x --grad-accum random windows: no epochs
        set_lr(optimizer, lr_at(loop.global_step, args.steps, args.lr, args.warmup_steps, "cosine"))
        for inputs, targets in micro_batches:  # DDP averages the gradients over the ranks on the last one
            loop.backward(loss_fn(model(inputs).flatten(0, 1), targets.flatten()))
        if args.grad_clip:  # the global norm: the gradients are already averaged
            nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if loop.step():
            break
    return loop.finish({"vocabulary": len(vocab), "uniform_loss": math.log(len(vocab))})


@torch.no_grad()
def generate(
    net: nn.Module, vocab: list[str], index: dict[str, int], device: torch.device, block: int, length: int = 200
) -> str:
    """A sample continuing a newline, drawn from its own generator: the training's random streams stay put."""
    generator = torch.Generator(device=device).manual_seed(0)
    chars = torch.tensor([[index.get("\n", 0)]], device=device)
    for _ in range(length):
        probabilities = net(chars[:, -block:])[0, -1].softmax(dim=-1)
        chars = torch.cat([chars, torch.multinomial(probabilities, 1, generator=generator)[None]], dim=1)
    return "".join(vocab[i] for i in chars[0, 1:].tolist())


main = experiment_main("charlm", CharLMArgs, train, doc=__doc__, validate=validate, headline=("eval_loss",))

if __name__ == "__main__":
    main.run_and_exit()
