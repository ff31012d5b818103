"""Coding-agent training on SWE-smith-style tasks (paper section 4.3): the reusable parts.

    instances   task instances in SWE-smith's format, the repositories they run in, the static
                filters (empty statement, missing problem branch, too many tests)
    workspace   a rollout's checkout of its problem branch with the git history out of reach,
                and the reward: the agent's diff applied where the tests are, the tests run
    hacks       recognising the four reward hacks of section 4.3.2 in a command and its output
    environment mini-swe-agent's environment over `reins.sandbox` (git disabled, no network)
    prepare     `reins swe prepare`: the filters, the difficulty filter, the split, a report

The example that puts them together is examples/swe; docs/swe.md explains the pipeline.
"""
