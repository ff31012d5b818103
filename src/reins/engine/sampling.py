"""Sampling one next token per row, and the logprob the trainer needs for it.

The logprob reported for a sampled token is `log_softmax(logits / temperature)` at that token,
taken before top-p / top-k truncation: it is the policy's own probability (at temperature 1, the
one training uses), not the probability of the truncated distribution the token was drawn from.
Greedy rows (temperature 0) report `log_softmax(logits)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    """Strings that end the response; the text shown stops before them."""
    seed: int | None = None

    def generator(self) -> torch.Generator | None:
        if self.seed is None:
            return None
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        return generator


def sample_next(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` ([rows, vocab]), and its logprob (see the module docstring)."""
    logits = logits.float()
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)

    probs = logprobs.exp()
    truncated = [p.top_p < 1.0 or p.top_k > 0 for p in params]
    if any(truncated):
        probs = _truncate(probs, params)

    tokens: list[int] = []
    for row, generator in enumerate(generators):
        if bool(greedy[row]):
            tokens.append(int(torch.argmax(logits[row])))
        else:
            tokens.append(int(torch.multinomial(probs[row], 1, generator=generator)))
    chosen = torch.tensor(tokens)
    picked = logprobs[torch.arange(len(tokens)), chosen]
    return tokens, picked.tolist()


def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k then top-p (nucleus) per row; the most likely token always survives."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1])[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[-1] for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (ranks >= top_k[:, None]) | (mass_before >= top_p[:, None])
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
