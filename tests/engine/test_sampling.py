"""Sampling one token per row (`reins.engine.sampling`): pure functions on logits, no model."""

from __future__ import annotations

import pytest
import torch

from reins.engine.sampling import SamplingParams, UnsampleableRows, sample_next


def draws(logits: torch.Tensor, params: SamplingParams, rows: int, seed: int = 0) -> list[int]:
    """`rows` independent draws from one distribution, in one batched call."""
    torch.manual_seed(seed)
    tokens, _ = sample_next(logits.expand(rows, -1), [params] * rows, [None] * rows)
    return tokens


def distribution(vocab: int, mass: dict[int, float]) -> torch.Tensor:
    """Logits whose softmax puts `mass` on the given tokens and (almost) none elsewhere."""
    logits = torch.full((1, vocab), -1e4)
    for token, probability in mass.items():
        logits[0, token] = torch.log(torch.tensor(probability))
    return logits


def test_sampled_frequencies_follow_the_distribution() -> None:
    # Tokens in different 256-token blocks of the inverse-CDF search, and a vocabulary that is
    # not a multiple of the block.
    mass = {3: 0.1, 255: 0.2, 256: 0.3, 599: 0.4}
    tokens = draws(distribution(600, mass), SamplingParams(temperature=1.0), rows=20_000)
    for token, probability in mass.items():
        frequency = tokens.count(token) / len(tokens)
        sigma = (probability * (1 - probability) / len(tokens)) ** 0.5
        assert abs(frequency - probability) < 5 * sigma, (token, frequency)
    assert set(tokens) == set(mass)


def test_top_k_and_top_p_never_sample_a_dropped_token() -> None:
    logits = distribution(1000, {10: 0.5, 20: 0.3, 30: 0.15, 40: 0.05})
    assert set(draws(logits, SamplingParams(top_k=2), rows=2000)) == {10, 20}
    # Nucleus 0.6: token 10 (mass before it 0) and 20 (0.5 < 0.6); 30 has 0.8 before it.
    assert set(draws(logits, SamplingParams(top_p=0.6), rows=2000)) == {10, 20}
    # The most likely token always stays, however small top_p is.
    assert set(draws(logits, SamplingParams(top_p=0.01), rows=200)) == {10}


def test_a_nucleus_wider_than_the_candidates_is_found_by_a_full_sort() -> None:
    vocab = 5000
    logits = torch.linspace(0.0, 0.01, vocab)[None, :]  # nearly flat; token vocab-1 most likely
    probs = torch.softmax(logits[0], dim=-1).flip(0)  # by rank
    nucleus = int(((probs.cumsum(0) - probs) < 0.5).sum())
    assert nucleus > 2000
    ranks = [vocab - 1 - token for token in draws(logits, SamplingParams(top_p=0.5), rows=4000)]
    assert max(ranks) < nucleus
    assert max(ranks) > 1024  # beyond the partial sort's candidates


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(3, 700)
    tokens, logprobs = sample_next(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert tokens == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, dim=-1)[range(3), tokens]
    assert logprobs == expected.tolist()


def test_reported_logprob_is_of_the_tempered_distribution_before_truncation() -> None:
    logits = torch.randn(4, 700) * 4
    params = [
        SamplingParams(temperature=0.5, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.0),
    ]
    tokens, logprobs = sample_next(logits, params, [None] * 4)
    for row, p in enumerate(params):
        scale = p.temperature if p.temperature > 0 else 1.0
        expected = torch.log_softmax(logits[row] / scale, dim=-1)[tokens[row]]
        assert abs(logprobs[row] - float(expected)) < 1e-6


def test_a_seeded_row_samples_the_same_tokens_whatever_else_is_in_the_batch() -> None:
    logits = torch.randn(1, 900)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(rows: int) -> list[int]:
        params = [seeded] + [SamplingParams(temperature=1.0)] * (rows - 1)
        generator = seeded.generator()
        out = []
        for _ in range(20):
            tokens, _ = sample_next(
                logits.expand(rows, -1), params, [generator] + [None] * (rows - 1)
            )
            out.append(tokens[0])
        return out

    assert run(1) == run(5)
    assert len(set(run(1))) > 1


def test_a_temperature_below_the_greedy_threshold_is_greedy() -> None:
    """1e-45 / logits overflow to inf and their softmax to NaN: such a temperature is argmax."""
    logits = distribution(600, {7: 0.2, 300: 0.5, 599: 0.3})
    tokens, logprobs = sample_next(logits, [SamplingParams(temperature=1e-45)], [None])
    assert tokens == [300]
    assert logprobs == sample_next(logits, [SamplingParams(temperature=0)], [None])[1]


def test_logits_that_are_nan_or_infinite_are_refused_by_row_before_any_draw() -> None:
    logits = distribution(600, {7: 0.5, 300: 0.5}).repeat(3, 1)
    logits[0, 5] = float("nan")
    logits[2, 9] = float("inf")
    generators = [torch.Generator().manual_seed(1) for _ in range(3)]
    states = [g.get_state() for g in generators]
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_p=0.9)]
    with pytest.raises(UnsampleableRows) as refused:
        sample_next(logits, params, generators)
    assert refused.value.rows == [0, 2]
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True))


def test_logit_bias_and_penalties_reshape_the_draw_not_the_reported_logprob() -> None:
    """OpenAI's reshaping (`logit_bias`, then each sampled token's frequency and presence
    penalties) decides the token; the logprob reported is still the policy's own."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    policy = torch.log_softmax(logits[0], dim=-1)

    def greedy(outputs: list[int], **reshaping: object) -> tuple[int, float]:
        params = SamplingParams(temperature=0.0, **reshaping)  # type: ignore[arg-type]
        tokens, logprobs = sample_next(logits, [params], [None], [outputs])
        return tokens[0], logprobs[0]

    assert greedy([]) == (0, float(policy[0]))
    assert greedy([], logit_bias=((3, 3.5),)) == (3, float(policy[3]))  # -1 + 3.5 > 2
    assert greedy([0], presence_penalty=1.5)[0] == 1  # 2 - 1.5 < 1
    assert greedy([0], presence_penalty=0.5)[0] == 0  # 1.5 > 1
    assert greedy([0, 0], frequency_penalty=0.6)[0] == 1  # 2 - 1.2 < 1
    assert greedy([0], frequency_penalty=0.6)[0] == 0  # 1.4 > 1
    # A sampled row draws from the reshaped distribution: a bias of -100 removes a token.
    params = SamplingParams(temperature=1.0, logit_bias=((0, -100.0),))
    torch.manual_seed(0)
    tokens, logprobs = sample_next(logits.expand(500, -1), [params] * 500, [None] * 500)
    assert 0 not in tokens and set(tokens) == {1, 2, 3}
    assert logprobs == [float(policy[token]) for token in tokens]


def test_seeds_that_differ_past_their_low_32_bits_sample_differently() -> None:
    logits = torch.zeros(1, 900)
    params = SamplingParams(temperature=1.0)

    def draws(seed: int) -> list[int]:
        generator = SamplingParams(seed=seed).generator()
        return [sample_next(logits, [params], [generator])[0][0] for _ in range(20)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(2**32 + 5)
    assert draws(5) != draws(2**40 + 5)
    assert draws(-1) == draws(2**64 - 1)  # a negative seed counts from 2**64, as documented


def test_a_top_k_past_the_vocabulary_keeps_every_token() -> None:
    logits = torch.randn(2, 900)
    huge = SamplingParams(temperature=1.0, top_k=2**63, seed=3)
    whole = SamplingParams(temperature=1.0, top_k=900, seed=3)
    plain = SamplingParams(temperature=1.0)
    tokens, _ = sample_next(logits, [huge, plain], [huge.generator(), None])
    same, _ = sample_next(logits, [whole, plain], [whole.generator(), None])
    assert tokens[0] == same[0]


def test_top_p_is_taken_of_the_top_k_tokens_as_transformers_takes_it() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    probs = torch.tensor([0.2, 0.1, 0.1] + [0.6 / 897] * 897)
    logits = probs.log()[None, :]
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.5)
    warped = TopPLogitsWarper(0.5)(None, TopKLogitsWarper(3)(None, logits.clone()))
    kept = set(torch.nonzero(warped[0] > -torch.inf)[:, 0].tolist())
    assert kept == {0}
    drawn = set()
    for seed in range(200):
        generator = SamplingParams(seed=seed).generator()
        drawn.add(sample_next(logits, [params], [generator])[0][0])
    assert drawn == kept


def test_min_p_keeps_the_tokens_transformers_keeps() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper

    probs = torch.tensor([0.5, 0.3, 0.04] + [0.16 / 897] * 897)
    logits = probs.log()[None, :]
    warped = MinPLogitsWarper(0.1)(None, logits.clone())
    kept = set(torch.nonzero(warped[0] > -torch.inf)[:, 0].tolist())
    assert kept == {0, 1}
    for params in (
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.0, min_p=0.1, top_k=50, top_p=0.99),
    ):
        drawn = set()
        for seed in range(100):
            generator = SamplingParams(seed=seed).generator()
            drawn.add(sample_next(logits, [params], [generator])[0][0])
        assert drawn == kept


def test_repetition_penalty_reshapes_as_transformers_does_over_prompt_and_response() -> None:
    """vLLM's `repetition_penalty` (a token of the prompt or of the response so far: its logit
    divided by the penalty when positive, multiplied when not) gives the very logits of
    transformers' `RepetitionPenaltyLogitsProcessor` over the whole sequence; the logprob
    reported is still the policy's own. It was accepted and ignored."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, 1.5, 1.0, -0.5, 0.25, -2.0]])
    prompt, output = [0, 3], [3, 5]
    expected = RepetitionPenaltyLogitsProcessor(penalty=2.0)(
        torch.tensor([prompt + output]), logits.clone()
    )
    assert expected[0].tolist() == [1.0, 1.5, 1.0, -1.0, 0.25, -4.0]  # the hand case
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # Greedy: token 1 (1.5) beats the penalized token 0 (2 / 2).
    tokens, logprobs = sample_next(logits, [params], [None], [output], prompts=[prompt])
    assert tokens == [1]
    assert logprobs == [float(torch.log_softmax(logits[0], dim=-1)[1])]
    # Sampled: drawn from the penalized distribution (transformers' processed logits).
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    rows = 20_000
    torch.manual_seed(0)
    drawn, _ = sample_next(
        logits.expand(rows, -1),
        [params] * rows,
        [None] * rows,
        [output] * rows,
        [None] * rows,
        [prompt] * rows,
    )
    for token, probability in enumerate(torch.softmax(expected[0], dim=-1).tolist()):
        frequency = drawn.count(token) / rows
        sigma = (probability * (1 - probability) / rows) ** 0.5
        assert abs(frequency - probability) < 5 * sigma, (token, frequency, probability)
    # Below 1 it favours the tokens seen; a penalty on a row with nothing seen changes nothing.
    favour = SamplingParams(temperature=0.0, repetition_penalty=0.25)
    assert sample_next(logits, [favour], [None], [[]], prompts=[[2]])[0] == [2]  # 1 / 0.25 = 4
    assert sample_next(logits, [favour], [None], [[]], prompts=[[]])[0] == [0]
