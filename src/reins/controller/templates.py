"""Job and NetworkPolicy templates: YAML with `"{{name}}"` placeholders.

The YAML is parsed first and the placeholders are filled in the parsed tree, so a value is never
re-read as YAML: a string that is one whole placeholder (`command: "{{command}}"`) becomes the
value itself (a list, a number, a mapping); a placeholder inside a longer string is replaced by
the value's text (`name: "agent-{{rollout_id}}"`). Quote placeholders, as YAML reads a bare
`{{x}}` as a mapping. A dotted name reads into a mapping value: `{{input.instance.image_name}}`
is `values["input"]["instance"]["image_name"]`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import yaml

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_-]+)*)\s*\}\}")

DEFAULT_JOB_TEMPLATE = """\
# One attempt of one rollout. reins sets metadata.name, labels, backoffLimit: 0,
# restartPolicy: Never, activeDeadlineSeconds, ttlSecondsAfterFinished and the agent's env.
apiVersion: batch/v1
kind: Job
metadata:
  name: "{{job_name}}"
spec:
  template:
    spec:
      automountServiceAccountToken: false   # agents need no Kubernetes API
      containers:
        - name: agent
          image: "{{image}}"
          command: "{{command}}"
"""

DEFAULT_NETWORK_POLICY_TEMPLATE = """\
# Agent pods may reach the gateway (its LLM proxy and event API) and DNS, nothing else, and
# accept no connections: the paper's safeguard against reward hacking through the network.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: "{{name}}"
spec:
  podSelector:
    matchLabels: "{{agent_labels}}"
  policyTypes: [Ingress, Egress]
  ingress: []
  egress:
    - to: "{{gateway_peers}}"
      ports:
        - protocol: TCP
          port: "{{gateway_port}}"
    - to:
        - namespaceSelector: {}
          podSelector:
            matchLabels:
              k8s-app: kube-dns
      ports:
        - protocol: UDP
          port: 53
        - protocol: TCP
          port: 53
"""


class TemplateError(ValueError):
    """A template is not valid YAML, or uses a placeholder with no value."""


def placeholders(template: str) -> set[str]:
    """The names a template's placeholders use."""
    return set(_PLACEHOLDER.findall(template))


def render(template: str, values: Mapping[str, Any]) -> Any:
    """Parses `template` and fills its placeholders from `values`."""
    try:
        tree = yaml.safe_load(template)
    except yaml.YAMLError as error:
        raise TemplateError(f"the template is not valid YAML: {error}") from error
    return _fill(tree, values)


def _fill(node: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(node, dict):
        return {_fill(k, values): _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(item, values) for item in node]
    if not isinstance(node, str):
        return node
    whole = _PLACEHOLDER.fullmatch(node.strip())
    if whole is not None:
        # A copy: the rendered tree is changed afterwards (each container's env), and a value
        # shared by every render (`--set containers=[...]`) gave one rollout's environment,
        # token included, to the Jobs of others rendered before it was sent.
        return copy.deepcopy(_value(whole.group(1), values))
    return _PLACEHOLDER.sub(lambda m: str(_value(m.group(1), values)), node)


def _value(name: str, values: Mapping[str, Any]) -> Any:
    head, *path = name.split(".")
    if head not in values:
        known = ", ".join(sorted(values))
        raise TemplateError(
            f"the template uses {{{{{name}}}}}, which has no value here (known: {known})"
        )
    value = values[head]
    for depth, key in enumerate(path):
        if not isinstance(value, Mapping) or key not in value:
            where = ".".join([head, *path[:depth]])
            raise TemplateError(f"the template uses {{{{{name}}}}}, but {where} has no {key!r}")
        value = value[key]
    return value
