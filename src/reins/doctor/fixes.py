"""What addresses each problem `reins doctor` reports: one text per check, kept apart from the
checks so that the advice can be read (and corrected) in one place."""

from __future__ import annotations

FIXES: dict[str, str] = {
    "no_calls": (
        "the harness must send its LLM calls to the proxy: read OPENAI_BASE_URL and "
        "OPENAI_API_KEY (Anthropic clients: ANTHROPIC_BASE_URL, ANTHROPIC_AUTH_TOKEN) from the "
        "environment, or set them in its config (docs/harnesses.md); Codex and OpenCode need "
        "their config files written (reins.agent.write_codex_config, write_opencode_home)"
    ),
    "unserved": (
        "the proxy serves chat completions, completions, the Responses API, Anthropic Messages "
        "(with count_tokens) and the model list (docs/harnesses.md); a harness's other calls "
        "(embeddings, files, a path its base URL got wrong) get a 404 and leave no record: "
        "send them to a server of their own, or check the base URL the harness builds"
    ),
    "mismatch": (
        "the harness was shown text that the recorded tokens do not say, so training would "
        "reinforce tokens the harness never acted on: serve with the embedded engine, which ends "
        "responses exactly where the shown text ends (stops, special tokens, tool calls; "
        "docs/proxy.md, Fidelity), or turn off the engine's own output rewriting (a vLLM "
        "tool-call or reasoning parser, stop strings kept in the text)"
    ),
    "no_token_ids": (
        "the engine returned no token IDs: serve the policy with an engine that supports "
        "`return_token_ids` (the embedded engine, vLLM >= 0.10); a hosted API cannot be trained on"
    ),
    "no_logprobs": (
        "the engine returned no logprobs (or invalid ones) for the sampled tokens: serve the "
        "policy with the embedded engine or vLLM, which return one per token when asked"
    ),
    "failed": (
        "read the error: a 502 that names a connection means the engine is down or its URL is "
        "wrong (`--engine`); a request the engine refuses fails every time (a prompt past the "
        "context: a larger `reins engine --max-model-len` or a shorter history; a parameter the "
        "engine does not support); failed calls are not trained on"
    ),
    "no_trainable": (
        "every call was abandoned, failed, empty or recorded without tokens: a rollout of this "
        "harness gives the trainer nothing; the findings above say which, and each its fix"
    ),
    "models": (
        "the policy served every one of them (an unknown name goes to the first registered "
        "model), and each call is trained as the policy's: a judge or a summarizer the harness "
        "means to be another model is trained too. Call that model outside the proxy (its own "
        "base URL), or name the policy in every call"
    ),
    "abandoned": (
        "the harness's client timed out or hung up before the answer: raise its request timeout "
        "(openai `timeout=`, litellm `request_timeout`) above the engine's latency under load; "
        "abandoned calls are not trained on, and the harness's retry is kept"
    ),
    "empty": (
        "an answer that ends at its first token has nothing to train on; a stop string the model "
        "often writes first (e.g. a newline) causes it: drop that stop or let the answer start"
    ),
    "harness_exit": (
        "its last lines are quoted in the message (run the command alone to see all of its "
        "output); a run stopped at the time limit hangs or needs a longer `--timeout`; a run "
        "that fails is not a rollout the trainer can reward (the controller retries it as a new "
        "attempt)"
    ),
    "split:retokenized": (
        "the harness sent the answer back as text and the chat template re-encoded it into other "
        "tokens (same text): keep token reuse on at the proxy (the gateway's `token_reuse`, on "
        "by default; `reins doctor --token-reuse` to try it; docs/proxy.md) with an engine that "
        "takes token-ID prompts; it prompts the engine with the sampled tokens; without it each "
        "part is still trained on "
        "the tokens it sampled, only the shared prompt is trained again"
    ),
    "split:template": (
        "the harness sent its history back unchanged, but the chat template renders an earlier "
        "turn differently from how it was sampled (e.g. it drops `<think>` blocks once a new "
        "user turn follows): compare the two sides of the split example; use a template that "
        "keeps earlier turns as sampled, or accept one split per user turn"
    ),
    "split:edited": (
        "the harness changed, removed or reordered an earlier message of its history between "
        "calls (its system prompt included: without one a template fills in its default one; a "
        "date or a counter rewritten each call does the same): keep the messages already sent "
        "as they were, and put what changes in the new messages"
    ),
    "split:transformed": (
        "the harness changed the answer before sending it back (stripped or reformatted text, "
        "tool calls re-serialized in another form, a stop string added back): send assistant "
        "turns back exactly as received; with vLLM, turn off its tool-call parser"
    ),
    "split:dropped": (
        "the harness left an answer out of its history (mini-swe-agent does so with a rejected, "
        "malformed answer): expected; each part is trained on its own"
    ),
    "split:compacted": (
        "the harness summarised or removed earlier turns: expected when it compacts its context; "
        "raise its compaction threshold to split less often"
    ),
    "split:branch": (
        "the next call started a new conversation (a sub-agent, a fresh context): expected when "
        "the harness does so; otherwise check that it keeps its history"
    ),
    "split:unknown": (
        "pass the policy's tokenizer (`--tokenizer FOLDER`) to tell the reasons apart"
    ),
    "stop": (
        "a response that ends at a stop string must be recorded and shown without the stop "
        "(the embedded engine does so): with another engine, have the harness keep the stop "
        "text in its history, or drop the stop"
    ),
    "tool_round_trip": (
        "send tool-call turns back unchanged (same call IDs, names, arguments and content): the "
        "embedded engine then renders them as they were sampled (docs/proxy.md, Fidelity)"
    ),
    "no_tokenizer": (
        "pass the policy's tokenizer folder: `reins doctor --tokenizer FOLDER --engine URL -- ...`"
    ),
}
