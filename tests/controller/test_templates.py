"""Job and NetworkPolicy templates rendered, and Job deadlines read, without a cluster."""

from __future__ import annotations

import datetime
import json
import re

import pytest
from kubernetes.client import V1Job, V1JobSpec, V1JobStatus, V1ObjectMeta, V1PodTemplateSpec

from reins.controller.kubernetes import KubernetesReconciler, _deadline_of
from reins.controller.loop import Launch, LaunchError, agent_command
from reins.controller.templates import TemplateError, placeholders, render

ENV = {"REINS_MODE": "train", "OPENAI_API_KEY": "rk-at-token", "REINS_INPUT": "{}"}


def reconciler(**options: object) -> KubernetesReconciler:
    settings: dict[str, object] = {
        "namespace": "agents",
        "gateway_url": "http://10.0.0.7:8080",
        "agent": "my_agent:run",
        "values": {"image": "registry.local/agent:1"},
        **options,
    }
    return KubernetesReconciler(**settings)  # type: ignore[arg-type]


def launch(rollout_id: str = "r-1", attempt_id: int = 1, timeout_s: float | None = 12.2) -> Launch:
    return Launch(
        rollout_id, attempt_id, agent=None, env=ENV, timeout_s=timeout_s, incarnation="t0"
    )


def test_a_whole_placeholder_becomes_the_typed_value_and_a_partial_one_text() -> None:
    template = 'a: "{{items}}"\nb: "job-{{n}}-x"\nc: "{{ n }}"\nd: plain\n'
    assert render(template, {"items": [1, {"k": "v"}], "n": 7}) == {
        "a": [1, {"k": "v"}],
        "b": "job-7-x",
        "c": 7,
        "d": "plain",
    }
    assert placeholders(template) == {"items", "n"}


def test_a_value_is_never_read_as_yaml() -> None:
    rendered = render('cmd: "echo {{text}}"\n', {"text": "x\ninjected: true"})
    assert rendered == {"cmd": "echo x\ninjected: true"}


def test_a_missing_value_and_bad_yaml_are_named() -> None:
    with pytest.raises(TemplateError, match=r"uses \{\{image\}\}, which has no value"):
        render('image: "{{image}}"', {})
    with pytest.raises(TemplateError, match="not valid YAML"):
        render("a: [unclosed", {})


def test_a_template_value_missing_at_start_says_which_flag_to_pass() -> None:
    with pytest.raises(ValueError, match=re.escape("--set image=...")):
        reconciler(values={})


def test_the_job_gets_every_field_reins_relies_on_whatever_the_template_says() -> None:
    template = """
apiVersion: batch/v1
kind: Job
metadata:
  name: mine
  labels: {team: rl}
spec:
  backoffLimit: 6
  template:
    metadata:
    spec:
      restartPolicy: OnFailure
      containers:
        - name: agent
          image: "{{image}}"
          command: "{{command}}"
          env:
            - {name: OPENAI_API_KEY, value: stale}
            - {name: KEEP, value: me}
"""
    job = reconciler(job_template=template, ttl_after_finished_s=600).render_job(launch())
    assert re.fullmatch(r"reins-r-1-[0-9a-f]{8}-1", job["metadata"]["name"])
    assert job["metadata"]["namespace"] == "agents"
    assert job["metadata"]["labels"]["team"] == "rl"
    assert job["metadata"]["labels"]["reins.dev/attempt"] == "1"
    assert job["metadata"]["annotations"] == {
        "reins.dev/rollout-id": "r-1",
        "reins.dev/rollout-created": "t0",
    }
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] == 13
    assert job["spec"]["ttlSecondsAfterFinished"] == 600
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"]["reins.dev/role"] == "agent"
    assert pod["spec"]["restartPolicy"] == "Never"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "reins.controller.run_agent", "my_agent:run"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {**ENV, "KEEP": "me"}


def test_no_timeout_means_no_deadline_and_a_rollout_agent_wins() -> None:
    rec = reconciler()
    agent = "python grade.py --fast"
    job = rec.render_job(Launch("r-1", 2, agent, env=ENV, timeout_s=None, incarnation="t"))
    assert "activeDeadlineSeconds" not in job["spec"]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["/bin/sh", "-c", "python grade.py --fast"]


def test_a_command_placeholder_without_any_agent_cannot_launch() -> None:
    with pytest.raises(LaunchError, match=r"\{\{command\}\}"):
        reconciler(agent=None).render_job(launch())


def test_job_names_are_valid_unique_and_stable() -> None:
    rec = reconciler()
    long_id = "Run:" + "x" * 150
    names = {rec.job_name(key) for key in [("r-1", 1), ("R-1", 1), ("r-1", 2), (long_id, 1)]}
    assert len(names) == 4
    for name in names:
        assert len(name) <= 63 and name == name.lower() and name[0].isalnum()
    assert rec.job_name(("r-1", 1)) == reconciler().job_name(("r-1", 1))
    other = reconciler(controller_name="other")
    assert other.job_name(("r-1", 1)) != rec.job_name(("r-1", 1))


def test_the_network_policy_admits_only_the_gateway_and_dns() -> None:
    policy = reconciler().render_network_policy()
    assert policy["metadata"]["namespace"] == "agents"
    assert policy["spec"]["podSelector"]["matchLabels"]["reins.dev/role"] == "agent"
    assert policy["spec"]["ingress"] == []
    gateway, dns = policy["spec"]["egress"]
    assert gateway == {
        "to": [{"ipBlock": {"cidr": "10.0.0.7/32"}}],
        "ports": [{"protocol": "TCP", "port": 8080}],
    }
    assert {p["port"] for p in dns["ports"]} == {53}


def test_a_gateway_by_name_is_reached_through_its_pods_labels() -> None:
    policy = reconciler(gateway_url="http://reins-gateway.rl.svc:80").render_network_policy()
    (peer,) = policy["spec"]["egress"][0]["to"]
    assert peer == {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "reins-gateway"}}}
    custom = reconciler(
        gateway_url="http://gw:80",
        values={"image": "x", "gateway_peers": [{"ipBlock": {"cidr": "192.0.2.0/28"}}]},
    ).render_network_policy()
    assert custom["spec"]["egress"][0]["to"] == [{"ipBlock": {"cidr": "192.0.2.0/28"}}]


def test_agents_run_as_module_function_or_shell_command() -> None:
    assert agent_command("pkg.mod:solve", "py") == [
        "py",
        "-m",
        "reins.controller.run_agent",
        "pkg.mod:solve",
    ]
    assert agent_command("./run.sh --x 1", "py") == ["/bin/sh", "-c", "./run.sh --x 1"]
    assert agent_command("echo a:b", "py") == ["/bin/sh", "-c", "echo a:b"]


def test_a_field_of_the_rollouts_input_fills_a_dotted_placeholder() -> None:
    template = """
apiVersion: batch/v1
kind: Job
metadata: {name: x}
spec:
  template:
    spec:
      containers:
        - name: agent
          image: "{{registry}}/{{input.instance.image_name}}"
          command: "{{command}}"
          args: "{{input.instance.tests}}"
"""
    task = {"instance": {"image_name": "swesmith.x86_64.repo:abc", "tests": ["t::a", "t::b"]}}
    env = {**ENV, "REINS_INPUT": json.dumps(task)}
    rec = reconciler(job_template=template, values={"registry": "registry.local"})
    rec._check_templates()  # `input.*` is known at start: its value comes with each launch
    job = rec.render_job(Launch("r-1", 1, agent=None, env=env, timeout_s=None, incarnation="t"))
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.local/swesmith.x86_64.repo:abc"
    assert container["args"] == ["t::a", "t::b"]  # a whole placeholder keeps the value's type
    other = {**ENV, "REINS_INPUT": json.dumps({"instance": {}})}
    with pytest.raises(LaunchError, match=r"uses \{\{input.instance.image_name\}\}, but "
                       r"input.instance has no 'image_name'"):  # fmt: skip
        rec.render_job(Launch("r-2", 1, agent=None, env=other, timeout_s=None, incarnation="t"))
    assert placeholders(template) == {"registry", "command", "input.instance.image_name",
                                      "input.instance.tests"}  # fmt: skip
    with pytest.raises(TemplateError, match=r"uses \{\{nope.x\}\}, which has no value"):
        render('a: "{{nope.x}}"', {})
    with pytest.raises(ValueError, match=r"--set registry=\.\.\."):
        reconciler(job_template=template)._check_templates()


def job_started(at: datetime.datetime | None, deadline_s: int | None = 30) -> V1Job:
    created = datetime.datetime(2026, 12, 5, 12, 0, 0, tzinfo=datetime.UTC)
    return V1Job(
        metadata=V1ObjectMeta(name="j", creation_timestamp=created),
        spec=V1JobSpec(active_deadline_seconds=deadline_s, template=V1PodTemplateSpec()),
        status=V1JobStatus(start_time=at),
    )


def test_a_jobs_deadline_counts_from_its_start_and_never_before_it_was_seen() -> None:
    created = datetime.datetime(2026, 12, 5, 12, 0, 0, tzinfo=datetime.UTC).timestamp()
    started = datetime.datetime(2026, 12, 5, 12, 0, 4, tzinfo=datetime.UTC)
    # Seen when created (this machine's clock as the apiserver's): from the start time.
    assert _deadline_of(job_started(started), created) == (30, created + 4 + 30)
    # Not started yet: from its creation.
    assert _deadline_of(job_started(None), created) == (30, created + 30)
    # An apiserver clock 60 s behind this machine's: from when this controller saw it.
    assert _deadline_of(job_started(started), created + 60) == (30, created + 60 + 30)
    assert _deadline_of(job_started(started, deadline_s=None), created) == (None, None)


def test_a_value_shared_by_every_job_is_copied_into_each() -> None:
    """`--set containers=[...]`: every render got the one list, and writing a rollout's env into
    it gave the Jobs rendered before it was sent that rollout's environment and token."""
    containers = [{"name": "agent", "image": "img:1", "command": ["python", "-m", "agent"]}]
    rec = reconciler(
        job_template=(
            "apiVersion: batch/v1\nkind: Job\nspec:\n  template:\n    spec:\n"
            '      containers: "{{containers}}"\n'
        ),
        values={"containers": containers},
    )
    first = rec.render_job(Launch("r-1", 1, None, {"REINS_ROLLOUT_ID": "r-1"}, 5, "t"))
    rec.render_job(Launch("r-2", 1, None, {"REINS_ROLLOUT_ID": "r-2"}, 5, "t"))
    (container,) = first["spec"]["template"]["spec"]["containers"]
    assert container["env"] == [{"name": "REINS_ROLLOUT_ID", "value": "r-1"}]
    assert "env" not in containers[0]  # the value itself is left as it was given


@pytest.mark.parametrize(
    ("timeout_s", "deadline"), [(float("inf"), None), (1e19, 2**63 - 1), (0.2, 1), (None, None)]
)
def test_a_timeout_becomes_a_deadline_the_api_takes(
    timeout_s: float | None, deadline: int | None
) -> None:
    """1e19 s was refused by the apiserver as the template's fault; `--timeout inf` raised an
    OverflowError, retried for ever (the attempt stayed running)."""
    job = reconciler().render_job(launch(timeout_s=timeout_s))
    assert job["spec"].get("activeDeadlineSeconds") == deadline


@pytest.mark.parametrize(
    "containers",
    [
        '{name: agent, image: "{{image}}"}',
        '[{name: agent, image: "{{image}}", env: {FOO: bar}}]',
        '["agent"]',
    ],
)
def test_a_template_whose_containers_or_env_are_no_lists_of_objects_fails_the_launch(
    containers: str,
) -> None:
    """Each was an AttributeError, retried for ever, the attempt running and no Job made."""
    template = (
        "apiVersion: batch/v1\nkind: Job\nspec:\n  template:\n    spec:\n"
        f"      containers: {containers}\n"
    )
    with pytest.raises(LaunchError, match="must be a list of objects"):
        reconciler(job_template=template).render_job(launch())


def test_network_policy_names_are_valid_and_apart_for_every_controller_name() -> None:
    """`Team` and `team` shared one policy, whose selector missed `Team`'s pods (unconfined);
    `x_` made a name the apiserver refused."""
    names = [
        reconciler(controller_name=name).render_network_policy()["metadata"]["name"]
        for name in ("team", "Team", "x_", "a" * 80, "a" * 79 + "b")
    ]
    assert names[0] == "reins-agents-team" and len(set(names)) == 5
    for name in names:
        assert re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", name), name


def test_two_controllers_in_one_namespace_are_two_lease_holders() -> None:
    """They were one holder: both took the gateway's lease and launched every rollout."""
    assert (
        reconciler(controller_name="a").lease_holder != reconciler(controller_name="b").lease_holder
    )
