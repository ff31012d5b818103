"""The policy's entropy at each response token, from the log-softmax the loss already holds.

Computed a few rows at a time: the temporaries are `ROWS` rows of the vocabulary, never a second
[tokens x vocabulary] tensor. With a gradient (the entropy bonus, `entropy_coef`), the backward
needs nothing but the log-softmax, which the log-softmax's own backward keeps anyway; autograd on
`-(p * log p).sum()` would keep `p` too, one more [tokens x vocabulary] tensor (~200 MB for 1,000
response tokens of a 49k vocabulary in fp32).
"""

from __future__ import annotations

from typing import Any

import torch

ROWS = 64
"""Response tokens whose entropy (or its gradient) is computed at once."""


def entropy(logprobs: torch.Tensor, *, with_gradient: bool) -> torch.Tensor:
    """-sum_v p_v log p_v per row of `logprobs` ([tokens x vocabulary] log-softmax): [tokens].
    Without `with_gradient`, detached."""
    if with_gradient and logprobs.requires_grad:
        result: torch.Tensor = _Entropy.apply(logprobs)  # type: ignore[no-untyped-call]
        return result
    with torch.no_grad():
        return _entropy(logprobs)


def _entropy(logprobs: torch.Tensor) -> torch.Tensor:
    parts = []
    for rows in torch.split(logprobs, ROWS):
        terms = rows.exp().mul_(rows)
        # A token of probability 0 (log-probability -inf) adds 0, not 0 * -inf.
        parts.append(-terms.nan_to_num_(0.0).sum(-1))
    return torch.cat(parts) if parts else logprobs.new_zeros(0)


class _Entropy(torch.autograd.Function):
    """H = -sum_v exp(l_v) l_v over log-probabilities l; dH/dl_v = -exp(l_v) (l_v + 1). Through
    the log-softmax's backward this is the familiar -p_v (log p_v + H) on the logits."""

    @staticmethod
    def forward(ctx: Any, logprobs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logprobs)
        return _entropy(logprobs.detach())

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        (logprobs,) = ctx.saved_tensors
        grad = torch.empty_like(logprobs)
        for rows, out, upstream in zip(
            torch.split(logprobs, ROWS),
            torch.split(grad, ROWS),
            torch.split(grad_output, ROWS),
            strict=True,
        ):
            torch.add(rows, 1.0, out=out)
            out.mul_(rows.exp()).nan_to_num_(0.0).mul_(-upstream[:, None])
        return grad
