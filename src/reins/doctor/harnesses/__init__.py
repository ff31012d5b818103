"""The named harnesses of `reins doctor NAME`: one small driver program per harness, run as
`python -m reins.doctor.harnesses.MODULE` inside the rollout environment the doctor gives
(OPENAI_BASE_URL, ANTHROPIC_BASE_URL, the attempt's token as their keys).

Every driver holds the same multi-turn task with a tool (`task`: the weather tool, a few-shot
history that keeps the small default model calling it, a tool result or a follow-up question
after each answer) in its library's own API, and sends each answer back exactly as the library
returned it, as a real agent does. A driver whose library is missing exits with `MISSING_EXIT`
and a line naming the package to install. The registry (names, modules, packages) is
`reins.doctor.named`. Nothing here imports the tests.
"""
