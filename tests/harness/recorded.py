"""What a recorded call must hold beyond its lengths, checked against the embedded engine:

- its response logprobs are the policy's own: finite, <= 0, and equal, within
  `LOGPROB_TOLERANCE`, to what the trainer computes for the same tokens (`TorchBackend`'s own
  forward, on the engine's weights, at the sampling temperature of `train` calls);
- its prompt is the chat template applied to the messages the harness sent (for OpenAI chat
  calls; the other wire APIs are translated first, see tests/gateway/test_wire_*.py), with the
  engine's documented rewrites (`reins.engine.chat.prepare_messages`: tool-call answers rendered
  as they were sampled, tools described in the system prompt when the template has no tools).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from reins.engine.chat import SampledTurns, prepare_messages, template_knows_tools
from reins.samples.batch import TrainingSequence
from reins.trainer.backend import BackendConfig, TorchBackend, _pack
from tests.embedded_support import ServedEngine

LOGPROB_TOLERANCE = 1e-3
"""Largest |engine logprob - trainer logprob| of a token. Both run the same float32 weights on
the CPU; the engine batches sequences and reuses cached prefixes (another summation order), the
trainer runs one forward over prompt and response: they agree to ~1e-5 (measured here; a wrong
temperature or a wrong token is off by 1e-1 or more)."""

TRAIN_TEMPERATURE = 1.0
"""`train` calls are sampled at temperature 1 (the gateway's default `train_sampling`)."""


def _sequence(prompt: list[int], response: list[int]) -> TrainingSequence:
    ids = np.asarray(prompt + response, dtype=np.int32)
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(prompt) :] = True
    return TrainingSequence(
        token_ids=ids,
        loss_mask=mask,
        old_logprobs=np.zeros(len(ids), dtype=np.float32),
        advantage=1.0,
        loss_weight=mask.astype(np.float32),
        reward=0.0,
        rollout_id="check",
        group_id=None,
        attempt_id=1,
        call_seqs=(),
        model_versions=(),
        response_spans=((len(prompt), len(ids)),),
        minibatch=0,
    )


def trainer_logprobs(served: ServedEngine, prompt: list[int], response: list[int]) -> list[float]:
    """The trainer's logprob of each response token, on the engine's own weights."""
    model = served.engine.model
    backend = TorchBackend(model, BackendConfig(temperature=TRAIN_TEMPERATURE, lr=0.0))
    tensors = _pack([_sequence(prompt, response)], backend.device)
    with torch.no_grad():
        logprobs, _ = backend._response_logprobs(backend.policy, tensors, with_entropy=False)
    return [float(value) for value in logprobs.cpu()]


def assert_logprobs_are_the_policys(served: ServedEngine, calls: list[dict[str, Any]]) -> None:
    for number, call in enumerate(calls, start=1):
        tokens, logprobs = call["response_token_ids"], call["response_logprobs"]
        assert logprobs is not None and len(logprobs) == len(tokens), f"call {number}"
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs), f"call {number}: {logprobs}"
        if call.get("mode", "train") != "train":
            continue  # sampled at the harness's own temperature
        expected = trainer_logprobs(served, call["prompt_token_ids"], tokens)
        worst = max(abs(a - b) for a, b in zip(logprobs, expected, strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"call {number}: logprobs off by up to {worst:.2e}"


def assert_prompts_are_the_template(served: ServedEngine, calls: list[dict[str, Any]]) -> None:
    tokenizer = served.tokenizer
    native = template_knows_tools(getattr(tokenizer, "chat_template", None))
    turns = SampledTurns()
    for number, call in enumerate(calls, start=1):
        request = call["request"]
        if call.get("kind", "chat") == "chat" and isinstance(request.get("messages"), list):
            tools = request.get("tools") if request.get("tool_choice") != "none" else None
            messages = prepare_messages(
                request["messages"], tools, native_tools=native, sampled=turns
            )
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools if native else None,
                add_generation_prompt=True,
                tokenize=False,
            )
            decoded = tokenizer.decode(call["prompt_token_ids"], skip_special_tokens=False)
            assert decoded == text, f"call {number}: the prompt is not the template's rendering"
        choices = (call.get("response") or {}).get("choices") or [{}]
        message = choices[0].get("message") or {}
        if message.get("tool_calls"):
            answer = served.engine.decode(call["response_token_ids"])
            turns.remember(answer, message.get("content"), message["tool_calls"])
