"""What the adapter did to a batch, as numbers a trainer logs each step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from reins.samples.diagnose import SPLIT_REASONS
from reins.samples.merge import MergedSequence, Split
from reins.samples.planning import MiniBatchPlan


@dataclass(frozen=True, slots=True)
class SampleMetrics:
    rollouts: int
    """Rollouts in the batch."""
    empty_rollouts: int
    """Rollouts that produced no sequence (every call failed or was skipped)."""
    sequences: int
    """Training sequences built."""
    one_sample_rollout_ratio: float
    """Share of non-empty rollouts that stayed one sequence (paper: 36% in coding-agent runs)."""
    samples_per_rollout: float
    """Mean sequences per non-empty rollout (paper: 2.4)."""
    split_reasons: dict[str, int] = field(default_factory=dict)
    """Boundaries that could not merge, by reason (every reason present, 0 when none)."""
    calls: int = 0
    """Calls kept after dedup (each one ends up in exactly one sequence)."""
    dedup_calls: int = 0
    """Calls dropped as retries of a later call with the same prompt."""
    skipped_calls: int = 0
    """``model_request`` events the converter skipped (failed, or no tokens)."""
    other_model_calls: int = 0
    """Calls another registered model served (a judge on its own engine): not the policy's."""
    call_tokens: int = 0
    """Sum over kept calls of prompt + response tokens: the cost of training each call alone."""
    trained_tokens: int = 0
    """Sum of merged sequence lengths: the cost of the forward/backward passes after merging."""
    response_tokens: int = 0
    """Tokens with loss on (sampled by the policy)."""
    merge_token_saving: float = 0.0
    """``1 - trained_tokens / call_tokens``: the compute merging saved."""
    mixed_version_sequences: int = 0
    """Sequences whose calls were served by more than one (known) weight version."""
    minibatches: int = 0
    microbatches: int = 0
    oversize_sequences: int = 0
    """Sequences longer than the micro-batch token bound (each alone in its micro-batch)."""
    rank_imbalance: float = 1.0
    """Worst mini-batch's max rank tokens / mean rank tokens (1.0 = perfectly balanced)."""

    def as_dict(self, prefix: str = "samples/") -> dict[str, float]:
        """Flat numbers for a metrics logger; split reasons as ``split/<reason>``."""
        out: dict[str, float] = {}
        for f in fields(self):
            name, value = f.name, getattr(self, f.name)
            if isinstance(value, dict):
                for reason, count in value.items():
                    out[f"{prefix}split/{reason}"] = float(count)
            else:
                out[f"{prefix}{name}"] = float(value)
        return out


def compute_metrics(
    *,
    rollouts: int,
    sequences_per_rollout: Sequence[int],
    sequences: Sequence[MergedSequence],
    splits: Sequence[Split],
    call_tokens: int,
    calls: int,
    dedup_calls: int,
    skipped_calls: int,
    minibatches: Sequence[MiniBatchPlan],
    other_model_calls: int = 0,
) -> SampleMetrics:
    """Aggregate one batch's figures; ``sequences_per_rollout`` has one count per rollout."""
    nonempty = [n for n in sequences_per_rollout if n > 0]
    reasons: Counter[str] = Counter(dict.fromkeys(SPLIT_REASONS, 0))
    reasons.update(s.reason for s in splits)
    trained = sum(s.token_ids.size for s in sequences)
    imbalance = 1.0
    for mb in minibatches:
        mean = sum(mb.rank_tokens) / len(mb.rank_tokens)
        if mean > 0:
            imbalance = max(imbalance, max(mb.rank_tokens) / mean)
    return SampleMetrics(
        rollouts=rollouts,
        empty_rollouts=rollouts - len(nonempty),
        sequences=len(sequences),
        one_sample_rollout_ratio=(sum(n == 1 for n in nonempty) / len(nonempty))
        if nonempty
        else 0.0,
        samples_per_rollout=(sum(nonempty) / len(nonempty)) if nonempty else 0.0,
        split_reasons=dict(reasons),
        calls=calls,
        dedup_calls=dedup_calls,
        skipped_calls=skipped_calls,
        other_model_calls=other_model_calls,
        call_tokens=call_tokens,
        trained_tokens=trained,
        response_tokens=sum(s.response_tokens for s in sequences),
        merge_token_saving=(1.0 - trained / call_tokens) if call_tokens else 0.0,
        mixed_version_sequences=sum(
            len({v for v in s.model_versions if v is not None}) > 1 for s in sequences
        ),
        minibatches=len(minibatches),
        microbatches=sum(len(rank) for mb in minibatches for rank in mb.micro_batches),
        oversize_sequences=sum(mb.oversize for mb in minibatches),
        rank_imbalance=imbalance,
    )
