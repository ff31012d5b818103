"""Sampling one next token per row, and the logprob the trainer needs for it.

The logprob reported for a sampled token is `log_softmax(logits / temperature)` at that token,
taken before top-p / top-k / min-p truncation and before `logit_bias` and the repetition,
presence and frequency penalties: it is the policy's own probability (at temperature 1, the one
training uses), not the probability of the reshaped or truncated distribution the token was
drawn from. Greedy rows (temperature below `GREEDY_TEMPERATURE`, 0 included) report
`log_softmax(logits)` and take the argmax of the reshaped logits.

The reshaping is OpenAI's: a token's logit gets its `logit_bias`, less `frequency_penalty` times
the number of times the response has sampled it so far, less `presence_penalty` once it has;
before those two, vLLM's `repetition_penalty` divides the logit of every token of the prompt or
the response so far by it when positive, multiplies it when not (the order vLLM applies them); with
structured output (`constraint.py`) the tokens its grammar does not allow next are masked out, and
with vLLM's `min_tokens` the ends of sequence until that many tokens were sampled.

A row whose logits are no distribution (NaN, or +inf) is refused with `UnsampleableRows` before
anything is drawn, so the caller can fail that row alone and sample the others.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

Generator = torch.Generator | np.random.Generator
"""Where a row's uniform numbers come from: a seeded request's own `np.random.Generator`
(`SamplingParams.generator`), or a torch one."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    min_p: float = 0.0
    """vLLM's: tokens less likely than `min_p` times the most likely one are dropped (0: none)."""
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    """Strings that end the response; the text shown stops before them."""
    stop_token_ids: frozenset[int] = frozenset()
    """Tokens that end the response (the API passes the special tokens other than end-of-turn)."""
    tool_calls: bool = False
    """Tools are offered: text after a `</tool_call>` that opens no other call ends the response
    (`chat.tool_turn_end`, checked on the last `TOOL_TURN_TOKENS` tokens)."""
    parallel_tool_calls: bool = True
    """False (the request's `parallel_tool_calls: false`): the first `</tool_call>` ends the
    response, so the answer has one call at most."""
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token ID, bias) added to that token's logit before sampling."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """vLLM's: above 1 the tokens of the prompt and of the response so far are less likely, below 1
    more (1: off)."""
    grammar: str | None = None
    """Structured output: the compiled grammar the response follows (`constraint.py`)."""
    min_tokens: int = 0
    """vLLM's: the tokens in `end_token_ids` cannot be drawn before this many were sampled."""
    end_token_ids: frozenset[int] = frozenset()
    """End-of-sequence and `stop_token_ids`: what `min_tokens` holds back."""
    top_logprobs: int = 0
    """How many of the most likely tokens each sampled one reports beside it (`alternatives`)."""

    @property
    def reshapes(self) -> bool:
        """Whether the logits are reshaped before sampling (see the module's doc)."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or self.grammar is not None
            or self.min_tokens > 0
        )

    def generator(self) -> torch.Generator | None:
        """The seeded request's own generator. torch's CPU generator keeps only the low 32 bits
        of its seed (seeds 5, 2**32 + 5 and 2**40 + 5 sampled the very same answer): a seed past
        them is first folded into 32 bits by a hash of all 64, while a seed under 2**32 keeps its
        stream, so every answer sampled with one before is sampled again (a new stream, PCG64,
        moved the draws of every seed; one then fell where float noise between the prefix
        cache's and a full prefill's logits picks another token)."""
        if self.seed is None:
            return None
        seed = self.seed % 2**64
        if seed >= 2**32:
            folded = hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=4).digest()
            seed = int.from_bytes(folded, "little")
        generator = torch.Generator()
        generator.manual_seed(seed)
        return generator


GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (as in vLLM): logits divided by a tinier one overflow float32
to infinity, and their softmax to NaN."""


class UnsampleableRows(ValueError):
    """The logits of `rows` are NaN or infinite; nothing was sampled (no generator drew)."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"the logits of rows {rows} are NaN or infinite: nothing to sample from")
        self.rows = rows


class NothingAllowed(UnsampleableRows):
    """Every token of `rows` is masked: its grammar allows only the end of the answer, which its
    `min_tokens` forbids yet. Sampled, such a row indexed past the vocabulary (a 500 for every
    request in the batch); greedy, it took token 0, which its grammar then refused."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(rows)
        self.args = (f"no token may come next in rows {rows}: every one is masked",)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


TOOL_TURN_TOKENS = 32
"""How many of the last sampled tokens are decoded to see whether a tool-call turn ended: a
`</tool_call>` (5 tokens in the default tokenizer), whitespace, and the text after it."""

CANDIDATES = (64, 1024)
"""Top-p and top-k look for their tokens among the 64, then the 1024 most likely tokens (a partial
sort); only a row whose kept set may be wider than that sorts the whole vocabulary."""
BLOCK = 256
"""Inverse-CDF sampling first finds the block of this many tokens where the draw falls, then the
token inside it: float64 sums of a few hundred values instead of a cumulative sum over the whole
vocabulary."""


def sample_next(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[Generator | None],
    outputs: list[list[int]] | None = None,
    allowed: list[torch.Tensor | None] | None = None,
    prompts: list[list[int]] | None = None,
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` ([rows, vocab]), and its logprob (see the module docstring).
    `outputs`: each row's response so far, which the penalties count (needed when a row has one).
    `allowed`: per row, None or which tokens its grammar allows next (booleans, [vocab]).
    `prompts`: each row's prompt, which `repetition_penalty` counts with the response (needed
    when a row has one).

    A sampled row draws one uniform number from its generator (the global one when it has none)
    and takes the token where that number falls in the row's cumulative distribution: one random
    number per token, where `torch.multinomial` draws one per vocabulary entry.
    """
    logits = logits.float()
    greedy = torch.tensor([is_greedy(p) for p in params])
    scale = _scale(params)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
    # NaN logits, or an infinite one, make a row's log-softmax NaN; sampling it would pick a
    # token outside the vocabulary.
    unsampleable = torch.isnan(logprobs).any(dim=-1)
    if bool(unsampleable.any()):
        raise UnsampleableRows(torch.nonzero(unsampleable)[:, 0].tolist())
    drawn_from, shaped = logprobs, logits
    if any(p.reshapes for p in params):
        shaped = _reshaped(
            logits,
            params,
            outputs or [[] for _ in params],
            allowed or [None for _ in params],
            prompts or [[] for _ in params],
        )
        blocked = torch.isneginf(shaped).all(dim=-1)
        if bool(blocked.any()):
            raise NothingAllowed(torch.nonzero(blocked)[:, 0].tolist())
        drawn_from = torch.log_softmax(shaped / scale[:, None], dim=-1)

    tokens = torch.zeros(len(params), dtype=torch.long)
    sampled = [row for row, p in enumerate(params) if not is_greedy(p)]
    if len(sampled) < len(params):
        rows = torch.nonzero(greedy)[:, 0]
        tokens[rows] = shaped[rows].argmax(dim=-1)
    for group in (
        [row for row in sampled if not _truncates(params[row])],
        [row for row in sampled if _truncates(params[row])],
    ):
        if not group:
            continue
        index = torch.tensor(group)
        probs = drawn_from.exp() if len(group) == len(params) else drawn_from[index].exp()
        uniforms = torch.tensor([_uniform(generators[row]) for row in group], dtype=torch.float64)
        if _truncates(params[group[0]]):
            tokens[index] = _sample_truncated(probs, [params[row] for row in group], uniforms)
        else:
            tokens[index] = _inverse_cdf(probs, uniforms)
    picked = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), picked.tolist()


Alternatives = tuple[tuple[int, float], ...]
"""The most likely tokens at one position and their logprobs, most likely first."""


def alternatives(logits: torch.Tensor, params: list[SamplingParams]) -> list[Alternatives]:
    """Per row of `logits`, its `top_logprobs` most likely tokens in the distribution whose
    logprob `sample_next` reports (the policy's own: before truncation, bias, penalties and
    grammar), so the sampled token's logprob is the one it has among them."""
    found: list[Alternatives] = [() for _ in params]
    rows = [row for row, p in enumerate(params) if p.top_logprobs > 0]
    if not rows:
        return found
    index = torch.tensor(rows)
    logprobs = torch.log_softmax(logits[index].float() / _scale(params)[index][:, None], dim=-1)
    values, tokens = torch.topk(logprobs, max(params[row].top_logprobs for row in rows), dim=-1)
    for position, row in enumerate(rows):
        width = params[row].top_logprobs
        found[row] = tuple(
            zip(tokens[position, :width].tolist(), values[position, :width].tolist(), strict=True)
        )
    return found


def _uniform(generator: Generator | None) -> float:
    """One number drawn uniformly from [0, 1) by `generator` (torch's global one when None)."""
    if isinstance(generator, np.random.Generator):
        return float(generator.random())
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _scale(params: list[SamplingParams]) -> torch.Tensor:
    """What each row's logits are divided by: its temperature, 1 for a greedy row."""
    return torch.tensor(
        [1.0 if is_greedy(p) else p.temperature for p in params], dtype=torch.float32
    )


def _reshaped(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]],
    allowed: list[torch.Tensor | None],
    prompts: list[list[int]],
) -> torch.Tensor:
    """The logits the rows are drawn from: each reshaping row's with its bias and penalties,
    and without the tokens its grammar does not allow."""
    shaped = logits.clone()
    vocab = logits.shape[-1]
    for row, p in enumerate(params):
        if not p.reshapes:
            continue
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            shaped[row, list(ids)] += torch.tensor(biases, dtype=shaped.dtype)
        if p.repetition_penalty != 1 and (prompts[row] or outputs[row]):
            seen = torch.tensor(sorted({*prompts[row], *outputs[row]}))
            logit = shaped[row, seen]
            penalty = p.repetition_penalty
            shaped[row, seen] = torch.where(logit > 0, logit / penalty, logit * penalty)
        if outputs[row] and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(outputs[row]), minlength=vocab)[:vocab]
            shaped[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if len(outputs[row]) < p.min_tokens and p.end_token_ids:
            shaped[row, sorted(p.end_token_ids)] = -torch.inf
        mask = allowed[row]
        if mask is not None:
            shaped[row].masked_fill_(~mask, -torch.inf)
    return shaped


def _truncates(params: SamplingParams) -> bool:
    return params.top_p < 1.0 or params.top_k > 0 or params.min_p > 0


def _sample_truncated(
    probs: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """Min-p and top-k, then top-p (nucleus) per row, the most likely token always kept; then
    inverse-CDF sampling among the kept tokens. Min-p and top-k each keep the most likely tokens,
    so together they keep the `top_k` most likely ones at most, those min-p keeps among them."""
    vocab = probs.shape[-1]
    # Capped at the vocabulary: a request's top_k of 2**63 or more does not fit a tensor (it was
    # a 500 for every request prefilled beside it).
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    if bool((min_p > 0).any()):
        likely = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        top_k = torch.minimum(top_k, likely.sum(dim=-1))
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    for width in (*(w for w in CANDIDATES if w < vocab), vocab):
        if width == vocab:
            values, order = torch.sort(probs, dim=-1, descending=True)
            break
        values, order = torch.topk(probs, width, dim=-1)
        # The tokens past the candidates are dropped when the candidates hold top_p of the mass
        # or top_k tokens.
        if bool(((values.sum(dim=-1) >= top_p) | (top_k <= width)).all()):
            break
    ranks = torch.arange(values.shape[-1])[None, :]
    mass_before = values.cumsum(dim=-1) - values
    # Top-p is taken of the top-k (and min-p) tokens' distribution (their mass renormalized), as
    # vLLM takes it (transformers' warpers too, for top-k): measured against the whole mass,
    # top_k 3 and top_p 0.5 over probabilities (0.2, 0.1, 0.1, ...) kept three tokens, not one.
    kept_by_k = _top_k_mass(probs, values, top_k)
    drop = (ranks >= top_k[:, None]) | (mass_before >= (top_p * kept_by_k)[:, None])
    drop[:, 0] = False
    chosen = _inverse_cdf(values.masked_fill(drop, 0.0), uniforms)
    return order.gather(1, chosen[:, None])[:, 0]


def _top_k_mass(probs: torch.Tensor, values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Per row, the probability mass of its `top_k` most likely tokens (`values`: the row's most
    likely probabilities, sorted, maybe fewer than the vocabulary)."""
    width, vocab = values.shape[-1], probs.shape[-1]
    masses = []
    for row, k in enumerate(top_k.tolist()):
        if k <= width:
            masses.append(values[row, :k].sum())
        elif k >= vocab:
            masses.append(probs[row].sum())
        else:
            masses.append(torch.topk(probs[row], k).values.sum())
    return torch.stack(masses)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the token whose interval of the cumulative distribution holds `uniform * total`
    (float64). A token of probability 0 has an empty interval and is never chosen."""
    rows, width = probs.shape
    blocks = -(-width // BLOCK)
    if width % BLOCK:
        probs = torch.nn.functional.pad(probs, (0, blocks * BLOCK - width))
    grid = probs.view(rows, blocks, BLOCK)
    block_cdf = grid.sum(dim=-1).double().cumsum(dim=-1)
    total = block_cdf[:, -1]
    # u < 1, but u * total may round up to total: keep the target inside the distribution.
    targets = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, targets[:, None], right=True)[:, 0]
    before = torch.nn.functional.pad(block_cdf, (1, 0)).gather(1, block[:, None])[:, 0]
    inner = grid[torch.arange(rows), block].double().cumsum(dim=-1)
    last = inner[:, -1]
    inside = torch.minimum(targets - before, torch.nextafter(last, torch.zeros_like(last)))
    offset = torch.searchsorted(inner, inside[:, None], right=True)[:, 0]
    return block * BLOCK + offset
