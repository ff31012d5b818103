"""A synthetic batch for timing or measuring an update (benchmarks/fsdp.py, trainer_memory.py):
`rows` sequences of `length` random tokens, the last `response` of them trained, half the rows
advantage +1 and half -1 (every sequence has a gradient), weights as eq. 16 gives them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from reins.samples.batch import TrainingSequence
from reins.samples.planning import plan_minibatch


def update_batch(
    rows: int,
    length: int,
    response: int,
    vocab: int,
    rng: np.random.Generator,
    *,
    dp_size: int = 1,
    max_tokens: int | None = None,
) -> Any:
    """What `train_step` reads of a `Batch`: its sequences and one mini-batch's plan."""
    sequences = []
    for row in range(rows):
        mask = np.zeros(length, bool)
        mask[-response:] = True
        sequences.append(
            TrainingSequence(
                token_ids=rng.integers(0, vocab, length),
                loss_mask=mask,
                old_logprobs=np.full(length, -2.0, np.float32),
                advantage=1.0 if row % 2 else -1.0,
                loss_weight=np.where(mask, 1.0 / (rows * response), 0.0).astype(np.float32),
                reward=float(row % 2),
                rollout_id=f"r{row}",
                group_id="g",
                attempt_id=0,
                call_seqs=(0,),
                model_versions=(0,),
                response_spans=((length - response, length),),
                minibatch=0,
            )
        )
    plan = plan_minibatch(
        list(range(rows)),
        list(range(rows)),
        np.full(rows, length),
        dp_size=dp_size,
        max_tokens=max_tokens,
    )
    return SimpleNamespace(sequences=sequences, minibatches=[plan])
