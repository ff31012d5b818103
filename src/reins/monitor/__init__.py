"""Monitoring: see every rollout and every training step, as a person or as an AI agent.

::

    runs        training runs on disk: `<runs_dir>/<run>/metrics.jsonl` and `config.yaml`
    panels      which metrics go in which chart (shared by the dashboard and `reins report`)
    svg         charts drawn server-side as inline SVG (the dashboard's run page)
    rollout     one rollout's page: calls in order, logprobs, merge/split at each boundary
    export      `reins export`: rollouts as JSONL, one per line
    report      `reins report`: PNG plots of a run's curves (matplotlib)
    prometheus  `/metrics`: calls, latency, in flight, held at the admission gate, rollouts
    dashboard   `/ui`: the routes, the login step, the templates
"""
