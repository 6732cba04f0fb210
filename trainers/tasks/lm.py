"""A GPT-style language model (trainers.gpt) trained on a token file (trainers.data.tokens): next-token
cross-entropy, with perplexity reported from the evaluation loss. `task.tokens` null trains on the
embedded corpus (CPython's English reference text), made once into the cache dir."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from trainers.data.tokens import VOCAB_SIZE, TokenDataError, TokenWindows, has_split, resolve_token_path
from trainers.gpt import GPT, GPTShape, next_token_loss
from trainers.task import StepOutput, TaskError


class LanguageModelTask:
    def __init__(self, tokens: str | None = None, context: int = 64, layers: int = 2, heads: int = 4, width: int = 128, dropout: float = 0.0) -> None:
        self.shape = GPTShape(vocab_size=VOCAB_SIZE, context=context, layers=layers, heads=heads, width=width, dropout=dropout)
        try:
            self.shape.check()
            self.path = resolve_token_path(tokens)
        except (ValueError, TokenDataError) as err:
            raise TaskError(f"task=lm: {err}") from None

    @property
    def tokens_per_sample(self) -> int:
        return self.shape.context  # the epoch line and metrics.jsonl show tokens/s

    def build_model(self) -> nn.Module:
        return GPT(self.shape)

    def _windows(self, split: str) -> TokenWindows:
        try:
            return TokenWindows(self.path, split, self.shape.context)
        except TokenDataError as err:
            raise TaskError(f"task=lm: {err}") from None

    def train_data(self) -> TokenWindows:
        return self._windows("train")

    def eval_data(self) -> TokenWindows:
        return self._windows("val")

    def test_data(self) -> TokenWindows | None:
        """A held-out "test" split, where the token file has one (python -m trainers.tokens writes train and val)."""
        return self._windows("test") if has_split(self.path, "test") else None

    def batch(self, items: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.stack([x for x, _ in items]).to(device, non_blocking=True)
        return inputs, torch.stack([y for _, y in items]).to(device, non_blocking=True)

    def train_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        inputs, targets = batch
        logits = model(inputs)
        correct = (logits.detach().argmax(dim=-1) == targets).float().mean(dim=1).sum()  # per window: the share right (stays on the device)
        return StepOutput(next_token_loss(logits, targets), len(inputs), {"token_accuracy": correct})

    def eval_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        return self.train_step(model, batch)

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """Weight decay on the matrices (linear and embedding weights) only, as GPT-2 trains:
        biases and layer-norm gains keep their scale."""
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        return [{"params": matrices}, {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]

    def checkpointed_modules(self, model: nn.Module) -> list[nn.Module]:
        assert isinstance(model, GPT)
        return list(model.blocks)

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        """Perplexity from the mean next-token loss (means per window of equal length: per token too)."""
        return {**means, "perplexity": math.exp(min(means["loss"], 50.0))}

    def describe(self) -> dict[str, Any]:
        return {"name": "gpt", **self.shape.__dict__, "tokens": str(self.path)}
