"""The Sample Adapter: recorded LLM calls in, planned training sequences out (pure functions).

Imports only ``reins.schemas``, numpy and the standard library; no torch, no I/O.

    records   rollout_from_events: gateway events -> RolloutRecord (calls + reward)
    merge     dedup_calls, merge_calls: retries dropped, best-effort merge (paper eq. 9)
    diagnose  diagnose_split: why a boundary could not merge
    advantage grpo_advantages, rloo_advantages: rollout- or sample-level (paper 2.2)
    loss      token-mean / seq-mean-token-mean / rollout-mean weights (paper eq. 14-16)
    planning  mini-batches that keep rollouts whole, micro-batches balanced over ranks (2.4)
    metrics   SampleMetrics
    batch     build_batch: all of the above
"""

from reins.samples.advantage import (
    AdvantageEstimator,
    AdvantageLevel,
    advantages,
    group_index,
    group_key,
    grpo_advantages,
    rloo_advantages,
    sequence_advantages,
)
from reins.samples.batch import (
    AdapterConfig,
    Batch,
    TrainingSequence,
    build_batch,
    step_loss_weights,
)
from reins.samples.diagnose import (
    REASONING_BLOCK,
    SPLIT_REASONS,
    Decode,
    SplitReason,
    diagnose_split,
    shared_prefix_len,
)
from reins.samples.loss import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    rollout_mean_scales,
    seq_mean_token_mean_scales,
    sequence_scales,
    token_mean_scales,
    token_weights,
)
from reins.samples.merge import MergedSequence, Split, dedup_calls, merge_calls
from reins.samples.metrics import SampleMetrics, compute_metrics
from reins.samples.planning import (
    MiniBatchPlan,
    assign_ranks,
    pack_microbatches,
    plan_minibatch,
    plan_minibatches,
)
from reins.samples.records import (
    Call,
    MissingRewardError,
    RolloutRecord,
    as_tokens,
    rollout_from_events,
)

__all__ = [
    "LOSS_AGGREGATIONS",
    "REASONING_BLOCK",
    "SPLIT_REASONS",
    "AdapterConfig",
    "AdvantageEstimator",
    "AdvantageLevel",
    "Batch",
    "Call",
    "Decode",
    "LossAggregation",
    "MergedSequence",
    "MiniBatchPlan",
    "MissingRewardError",
    "RolloutRecord",
    "SampleMetrics",
    "Split",
    "SplitReason",
    "TrainingSequence",
    "advantages",
    "as_tokens",
    "assign_ranks",
    "build_batch",
    "compute_metrics",
    "dedup_calls",
    "diagnose_split",
    "group_index",
    "group_key",
    "grpo_advantages",
    "merge_calls",
    "pack_microbatches",
    "plan_minibatch",
    "plan_minibatches",
    "rloo_advantages",
    "rollout_from_events",
    "rollout_mean_scales",
    "seq_mean_token_mean_scales",
    "sequence_advantages",
    "sequence_scales",
    "shared_prefix_len",
    "step_loss_weights",
    "token_mean_scales",
    "token_weights",
]
