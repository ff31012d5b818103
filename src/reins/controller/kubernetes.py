"""`KubernetesReconciler`: one Kubernetes Job per attempt (paper appendix A.2).

Uses the official `kubernetes` client: it is the Kubernetes project's own, its `Watch` exposes
resource versions and 410 Gone exactly as the standard controller pattern needs (watch for low
latency, relist on 410, list periodically for events a watch missed), and it is the client this
project's real-apiserver tests were checked against. Its calls are blocking, so they run in
worker threads; the watch has a thread of its own. Its import is heavy, so `reins.controller`
loads this module only when a Kubernetes runner is asked for.

Jobs come from a YAML template with `"{{name}}"` placeholders (`templates.py`). Whatever the
template says, every Job gets the reins labels and annotations, `backoffLimit: 0` (a failed pod
is a failed attempt: retries are the controller's, as new attempts), `restartPolicy: Never`,
`activeDeadlineSeconds` from the rollout's timeout, `ttlSecondsAfterFinished`, and the agent's
environment in every container. A NetworkPolicy lets agent pods reach only the gateway (and DNS).

The Job controller ends a Job at its deadline, but some Kubernetes releases miss deadlines
(kubernetes#105572, #110239; a stopped or overloaded controller manager too): a Job still running
`deadline_grace_s` past its deadline is deleted by this controller and its attempt timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import urllib3
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from reins.controller.loop import (
    RUNNING,
    TAIL_BYTES,
    AgentLog,
    Ended,
    Key,
    Launch,
    LaunchError,
    State,
    agent_command,
)
from reins.controller.templates import (
    DEFAULT_JOB_TEMPLATE,
    DEFAULT_NETWORK_POLICY_TEMPLATE,
    TemplateError,
    placeholders,
    render,
)

log = logging.getLogger("reins.controller.kubernetes")

MANAGED_BY = "app.kubernetes.io/managed-by"
CONTROLLER_LABEL = "reins.dev/controller"
ROLLOUT_LABEL = "reins.dev/rollout"
ATTEMPT_LABEL = "reins.dev/attempt"
ROLE_LABEL = "reins.dev/role"
ROLLOUT_ANNOTATION = "reins.dev/rollout-id"
"""The exact rollout id (labels cannot hold every id: `:` and more than 63 characters)."""
INCARNATION_ANNOTATION = "reins.dev/rollout-created"
"""The rollout's creation time at the gateway: tells it from an older rollout with its id."""

_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_NAME_UNSAFE = re.compile(r"[^a-z0-9-]+")


@dataclass
class _Job:
    name: str
    uid: str
    incarnation: str | None
    state: State
    """RUNNING until the Job is finished and its pod's exit code and log are collected."""
    seen_at: float
    """When this controller last learned the Job exists (monotonic); guards a list that started
    before the Job was created from calling it deleted."""
    log: AgentLog | None = None
    collecting: bool = False
    deadline_s: int | None = None
    """The Job's `activeDeadlineSeconds`."""
    deadline: float | None = None
    """When they run out (this machine's clock, never before `deadline_s` after `first_seen`)."""
    first_seen: float = 0.0
    """When this controller first saw the Job (this machine's clock)."""


class KubernetesReconciler:
    """Runs each attempt as a Job in `namespace`; Jobs outlive the controller and are adopted."""

    runner = "kubernetes"

    def __init__(
        self,
        *,
        namespace: str,
        gateway_url: str,
        kubeconfig: str | Path | None = None,
        agent: str | None = None,
        job_template: str = DEFAULT_JOB_TEMPLATE,
        network_policy_template: str | None = DEFAULT_NETWORK_POLICY_TEMPLATE,
        values: Mapping[str, Any] | None = None,
        controller_name: str = "reins",
        max_parallel: int = 64,
        ttl_after_finished_s: int = 3600,
        creations_per_s: float = 10.0,
        resync_s: float = 30.0,
        watch_timeout_s: int = 60,
        deadline_grace_s: float = 10.0,
        log_dir: Path | None = None,
        python: str = "python",
    ) -> None:
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be at least 1, not {max_parallel}")
        self.namespace = namespace
        # The controller's name too: two controllers in one namespace (each sees only its own
        # Jobs) were one holder, both launched every rollout and took each other's for lost.
        self.lease_holder = f"kubernetes {namespace} {controller_name}"
        self.gateway_url = gateway_url
        """The gateway as agent pods reach it: the NetworkPolicy lets them reach only this."""
        self.kubeconfig = str(kubeconfig) if kubeconfig else None
        self.agent = agent
        """Default agent (`{{command}}` in the template); a rollout's `config.agent` wins."""
        self.job_template = job_template
        self.network_policy_template = network_policy_template
        self.values = dict(values or {})
        """Values for the templates' own placeholders (`image`, ...)."""
        self.controller_name = controller_name
        self.max_parallel = max_parallel
        self.ttl_after_finished_s = ttl_after_finished_s
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        self.deadline_grace_s = deadline_grace_s
        """How long past a Job's deadline the Job controller may take to end it before this
        controller deletes it."""
        self.overdue_jobs = 0
        """Jobs this controller ended because the Job controller had not at their deadline."""
        self.log_dir = Path(log_dir).resolve() if log_dir else None
        self.python = python
        self.relists = 0
        """Full lists done so far (at start, periodic, after 410 Gone)."""
        self.watch_events = 0
        self.expired_watches = 0
        """Watches answered 410 Gone (their resource version was compacted), each relisted."""
        self._limiter = _RateLimiter(creations_per_s)
        self._jobs: dict[Key, _Job] = {}
        self._removed: set[str] = set()
        """uids of Jobs this controller deleted."""
        self._on_change: Callable[[], None] = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._api: Any = None
        self._batch: Any = None
        self._core: Any = None
        self._stop = threading.Event()
        self._watch: Any = None
        self._watch_thread: threading.Thread | None = None
        self._resync_task: asyncio.Task[None] | None = None
        self._deadline_task: asyncio.Task[None] | None = None
        self._collecting: set[asyncio.Task[None]] = set()
        self.selector = f"{MANAGED_BY}=reins,{CONTROLLER_LABEL}={_label_value(controller_name)}"
        self._check_templates()

    # -- protocol ---------------------------------------------------------------------------

    async def start(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self._loop = asyncio.get_running_loop()
        self._api = await asyncio.to_thread(self._new_api_client)
        self._batch = k8s.BatchV1Api(self._api)
        self._core = k8s.CoreV1Api(self._api)
        try:
            if self.network_policy_template is not None:
                await asyncio.to_thread(self._apply_network_policy)
            resource_version = await asyncio.to_thread(self._list)
        except ApiException as error:
            if error.status in _SETTINGS_REFUSED:  # not an outage: no retry will help
                raise ValueError(self._refused(error)) from None
            raise
        self._stop.clear()
        self._watch_thread = threading.Thread(
            target=self._watch_forever,
            args=(resource_version,),
            name="reins-job-watch",
            daemon=True,
        )
        self._watch_thread.start()
        self._resync_task = asyncio.create_task(self._resync_forever())
        self._deadline_task = asyncio.create_task(self._end_overdue_forever())

    async def close(self) -> None:
        """Stops watching. Jobs keep running: a next controller adopts them."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()  # shuts the watch's socket, so its thread returns now
        for task in (self._resync_task, self._deadline_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for task in list(self._collecting):
            task.cancel()
        await asyncio.gather(*self._collecting, return_exceptions=True)
        if self._watch_thread is not None:
            await asyncio.to_thread(self._watch_thread.join, 5.0)
        if self._api is not None:
            await asyncio.to_thread(self._api.close)
            self._api = None
        self._jobs.clear()

    def free_slots(self) -> int:
        return self.max_parallel - sum(1 for j in self._jobs.values() if j.state == RUNNING)

    def executions(self) -> Iterable[Key]:
        return list(self._jobs)

    def state(self, key: Key) -> State | None:
        job = self._jobs.get(key)
        return None if job is None else job.state

    def incarnation(self, key: Key) -> str | None:
        job = self._jobs.get(key)
        return None if job is None else job.incarnation

    async def find(self, key: Key, incarnation: str) -> State | None:
        # The list at start (and every resync) already brought every Job of this controller.
        job = self._jobs.get(key)
        return job.state if job is not None and job.incarnation == incarnation else None

    async def launch(self, launch: Launch) -> str:
        key = launch.key
        name = self.job_name(key)
        known = self._jobs.get(key)
        if known is not None:
            if known.incarnation != launch.incarnation:
                await self._replace(key, name)
            return f"job {self.namespace}/{name}"
        body = self.render_job(launch)
        await self._limiter.acquire()
        try:
            created = await asyncio.to_thread(
                self._batch.create_namespaced_job, self.namespace, body
            )
        except ApiException as error:
            if error.status == 409:
                # Created before (a previous controller, or a retried call): never twice.
                created = await asyncio.to_thread(
                    self._batch.read_namespaced_job, name, self.namespace
                )
                annotations = created.metadata.annotations or {}
                if annotations.get(INCARNATION_ANNOTATION) != launch.incarnation:
                    await self._replace(key, name)
            elif error.status in (400, 422):
                raise LaunchError(
                    f"the apiserver rejected Job {name}: {_api_message(error)}; check the Job "
                    "template"
                ) from error
            elif error.status in _SETTINGS_REFUSED:
                # Retried, the attempt stayed `running` for ever, its log full of HTTP headers.
                raise LaunchError(self._refused(error)) from error
            else:
                raise
        self._observe_job(created, time.monotonic())
        return f"job {self.namespace}/{name}"

    def _refused(self, error: ApiException) -> str:
        what = {401: "refuses the controller's credentials", 403: "forbids it", 404: "has no such"}
        return (
            f"the Kubernetes API {what.get(error.status or 0, 'refused it')} "
            f"({_api_message(error)}): check the namespace ({self.namespace}) exists and the "
            "controller's account may list, watch, create and delete Jobs and apply "
            "NetworkPolicies there (RBAC)"
        )

    async def _replace(self, key: Key, name: str) -> None:
        """A Job of an older rollout with this id holds the name: delete it, launch later."""
        await self.remove(key)
        raise RuntimeError(
            f"Job {self.namespace}/{name} belonged to an older rollout with id {key[0]}; it is "
            "deleted, and the new one is created on a later pass"
        )

    async def agent_log(self, key: Key) -> AgentLog:
        job = self._jobs.get(key)
        if job is not None and job.log is not None:
            return job.log
        name = self.job_name(key)
        return AgentLog(path=f"k8s://{self.namespace}/jobs/{name}", tail="")

    async def remove(self, key: Key) -> None:
        job = self._jobs.pop(key, None)
        name = job.name if job is not None else self.job_name(key)
        if job is not None:
            self._removed.add(job.uid)  # late watch events of it are ignored
        # The uid precondition deletes exactly the Job this controller saw, never a newer one
        # that took its name.
        body = {"preconditions": {"uid": job.uid}} if job is not None else None
        try:
            await asyncio.to_thread(
                self._batch.delete_namespaced_job,
                name,
                self.namespace,
                body=body,
                propagation_policy="Background",  # its pods go too
            )
        except ApiException as error:
            if error.status not in (404, 409):
                if job is not None:
                    self._removed.discard(job.uid)
                raise

    # -- naming and rendering ---------------------------------------------------------------

    def job_name(self, key: Key) -> str:
        """`reins-<rollout slug>-<hash>-<attempt>`: unique per controller, rollout and attempt,
        at most 63 characters (the pods' `job-name` label is limited so)."""
        rollout_id, attempt_id = key
        digest = hashlib.sha256(f"{self.controller_name}\0{rollout_id}".encode()).hexdigest()[:8]
        suffix = f"-{digest}-{attempt_id}"
        slug = _NAME_UNSAFE.sub("-", rollout_id.lower()).strip("-")
        slug = slug[: 63 - len("reins-") - len(suffix)].strip("-")
        return f"reins-{slug}{suffix}" if slug else f"reins{suffix}"

    def labels(self, key: Key) -> dict[str, str]:
        return {
            MANAGED_BY: "reins",
            CONTROLLER_LABEL: _label_value(self.controller_name),
            ROLLOUT_LABEL: _label_value(key[0]),
            ATTEMPT_LABEL: str(key[1]),
            ROLE_LABEL: "agent",
        }

    def render_job(self, launch: Launch) -> dict[str, Any]:
        """The Job for one attempt: the template rendered, then the fields reins relies on."""
        key = launch.key
        name = self.job_name(key)
        agent = launch.agent or self.agent
        values: dict[str, Any] = {
            **self.values,
            "job_name": name,
            "namespace": self.namespace,
            "rollout_id": key[0],
            "attempt_id": key[1],
            "mode": launch.env.get("REINS_MODE", ""),
            "timeout_s": _deadline_s(launch.timeout_s),
            "controller": self.controller_name,
        }
        if agent:
            values["agent"] = agent
            values["command"] = agent_command(agent, self.python)
        if "REINS_INPUT" in launch.env:  # `{{input.x.y}}`: a field of the rollout's task
            values["input"] = json.loads(launch.env["REINS_INPUT"])
        try:
            job = render(self.job_template, values)
        except TemplateError as error:
            raise LaunchError(str(error)) from error
        if not isinstance(job, dict) or job.get("kind") != "Job":
            raise LaunchError("the Job template must render to one object of `kind: Job`")
        labels = self.labels(key)
        meta = _child(job, "metadata")
        meta.update(name=name, namespace=self.namespace)
        _child(meta, "labels").update(labels)
        annotations = {ROLLOUT_ANNOTATION: key[0], INCARNATION_ANNOTATION: launch.incarnation}
        _child(meta, "annotations").update(annotations)
        spec = _child(job, "spec")
        spec["backoffLimit"] = 0
        spec["ttlSecondsAfterFinished"] = self.ttl_after_finished_s
        deadline = _deadline_s(launch.timeout_s)
        if deadline is not None:
            spec["activeDeadlineSeconds"] = deadline
        pod = _child(spec, "template")
        pod_meta = _child(pod, "metadata")
        _child(pod_meta, "labels").update(labels)
        _child(pod_meta, "annotations").update(annotations)
        pod_spec = _child(pod, "spec")
        pod_spec["restartPolicy"] = "Never"
        containers = _objects(pod_spec, "containers")
        if not containers:
            raise LaunchError("the Job template has no container")
        for container in [*containers, *_objects(pod_spec, "initContainers")]:
            kept = _objects(container, "env")
            env = [e for e in kept if e.get("name") not in launch.env]
            container["env"] = env + [{"name": k, "value": v} for k, v in launch.env.items()]
        return job

    def render_network_policy(self) -> dict[str, Any]:
        """The NetworkPolicy: agent pods of this controller may reach the gateway and DNS only."""
        assert self.network_policy_template is not None
        policy = render(self.network_policy_template, self._policy_values())
        if not isinstance(policy, dict) or policy.get("kind") != "NetworkPolicy":
            raise TemplateError("the NetworkPolicy template must render to `kind: NetworkPolicy`")
        meta = _child(policy, "metadata")
        meta["namespace"] = self.namespace
        _child(meta, "labels").update(
            {MANAGED_BY: "reins", CONTROLLER_LABEL: _label_value(self.controller_name)}
        )
        return policy

    def _policy_values(self) -> dict[str, Any]:
        url = urlsplit(self.gateway_url)
        host = url.hostname or ""
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            # A name: the gateway's pods, by label, in this namespace (override `gateway_peers`).
            peers: list[dict[str, Any]] = [
                {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "reins-gateway"}}}
            ]
        else:
            bits = 32 if address.version == 4 else 128
            peers = [{"ipBlock": {"cidr": f"{address}/{bits}"}}]
        return {
            "name": _object_name("reins-agents-", self.controller_name),
            "namespace": self.namespace,
            "controller": self.controller_name,
            "agent_labels": {
                MANAGED_BY: "reins",
                CONTROLLER_LABEL: _label_value(self.controller_name),
                ROLE_LABEL: "agent",
            },
            "gateway_peers": peers,
            "gateway_port": port,
            **self.values,
        }

    def _check_templates(self) -> None:
        """Fails at start, not at the first launch, when a template lacks a value."""
        known = {
            "job_name", "namespace", "rollout_id", "attempt_id", "mode", "timeout_s",
            "controller", "agent", "command", "input", *self.values,
        }  # fmt: skip
        missing = {name.split(".")[0] for name in placeholders(self.job_template)} - known
        if missing:
            raise ValueError(
                f"the Job template uses {', '.join(sorted(missing))} with no value: pass "
                + " ".join(f"--set {name}=..." for name in sorted(missing))
            )
        if self.network_policy_template is not None:
            self.render_network_policy()

    # -- the apiserver ----------------------------------------------------------------------

    def _new_api_client(self) -> Any:
        """ValueError saying what is wrong with the kubeconfig (missing, a folder, not YAML:
        they were tracebacks of the kubernetes client)."""
        from_file: Any = k8s_config.new_client_from_config
        in_cluster: Any = k8s_config.load_incluster_config
        try:
            if self.kubeconfig:
                return from_file(config_file=self.kubeconfig)
            try:
                configuration = k8s.Configuration()
                in_cluster(client_configuration=configuration)
                return k8s.ApiClient(configuration)
            except k8s_config.ConfigException:
                return from_file()  # ~/.kube/config or $KUBECONFIG
        except (k8s_config.ConfigException, OSError, yaml.YAMLError) as error:
            if self.kubeconfig and not Path(self.kubeconfig).exists():
                raise ValueError(f"--kubeconfig {self.kubeconfig}: no such file") from None
            where = self.kubeconfig or "$KUBECONFIG or ~/.kube/config, and not in a cluster"
            hint = "" if self.kubeconfig else "; pass --kubeconfig"
            raise ValueError(
                f"no usable Kubernetes configuration ({where}): {error}{hint}"
            ) from None

    def _apply_network_policy(self) -> None:
        policy = self.render_network_policy()
        api: Any = k8s.NetworkingV1Api(self._api)
        name = policy["metadata"]["name"]
        try:
            api.create_namespaced_network_policy(self.namespace, policy)
        except ApiException as error:
            if error.status != 409:
                raise
            api.replace_namespaced_network_policy(name, self.namespace, policy)

    def _list(self) -> str:
        """Lists every Job of this controller (in a worker thread); returns the list's version."""
        started = time.monotonic()
        items: list[Any] = []
        token = None
        while True:
            page = self._batch.list_namespaced_job(
                self.namespace, label_selector=self.selector, limit=500, _continue=token
            )
            items.extend(page.items)
            token = page.metadata._continue
            if not token:
                break
        self.relists += 1
        self._call_soon(self._apply_list, items, started)
        return str(page.metadata.resource_version)

    def _apply_list(self, items: list[Any], started: float) -> None:
        listed: set[Key] = set()
        for job in items:
            key = self._observe_job(job, started)
            if key is not None:
                listed.add(key)
        for key, job in list(self._jobs.items()):
            if key not in listed and job.state == RUNNING and job.seen_at < started:
                self._gone(key, job)

    def _watch_forever(self, resource_version: str) -> None:
        """The watch thread: streams Job events to the loop.

        A broken connection resumes from the last resource version (the apiserver replays what
        was missed); 410 Gone means that version is compacted away, so it relists first.
        """
        failures = 0
        while not self._stop.is_set():
            new_watch: Any = k8s_watch.Watch
            watch = self._watch = new_watch()
            try:
                for event in watch.stream(
                    self._batch.list_namespaced_job,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=resource_version,
                    timeout_seconds=self.watch_timeout_s,
                    allow_watch_bookmarks=True,
                    _request_timeout=(10, self.watch_timeout_s + 15),
                ):
                    failures = 0
                    # The client yields None for a line that is not an event (an empty line,
                    # JSON cut short): nothing to apply.
                    kind = event.get("type") if isinstance(event, dict) else None
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self.watch_events += 1
                        self._call_soon(self._apply_event, kind, event["object"])
                    resource_version = watch.resource_version or resource_version
                    if self._stop.is_set():
                        return
            except ApiException as error:
                if self._stop.is_set():
                    return
                if error.status == 410:
                    self.expired_watches += 1
                    log.info("Job watch expired (410 Gone); relisting")
                    resource_version = self._relist()
                    continue
                failures += 1
                log.warning("Job watch failed (%s); resuming", _api_message(error))
            except (urllib3.exceptions.HTTPError, OSError, ValueError) as error:
                if self._stop.is_set():
                    return
                failures += 1
                log.warning("Job watch broke (%r); resuming", error)
            except Exception:  # a thread that dies ends the watch unseen: never let it
                if self._stop.is_set():
                    return
                failures += 1
                log.exception("Job watch failed unexpectedly; resuming")
            self._stop.wait(min(5.0, 0.1 * 2**failures))

    def _relist(self) -> str:
        """A fresh list after 410 Gone; retried until the apiserver answers."""
        failures = 0
        while not self._stop.is_set():
            try:
                return self._list()
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
                failures += 1
                log.warning("Job list failed (%r); retrying", error)
                self._stop.wait(min(5.0, 0.1 * 2**failures))
        return ""

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s)
            try:
                await asyncio.to_thread(self._list)
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
                log.warning("periodic Job list failed (%r)", error)
            except Exception:  # the next list may succeed: a task that ends lists no more
                log.exception("periodic Job list failed unexpectedly")

    def _call_soon(self, function: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(function, *args)

    # -- the loop's view of Jobs ------------------------------------------------------------

    def _apply_event(self, kind: str, job: Any) -> None:
        if kind == "DELETED":
            key = _key_of(job)
            known = self._jobs.get(key) if key is not None else None
            if (
                key is not None
                and known is not None
                and known.uid == job.metadata.uid
                and known.state == RUNNING
            ):
                self._gone(key, known)
            return
        self._observe_job(job, time.monotonic())

    def _observe_job(self, job: Any, seen_at: float) -> Key | None:
        key = _key_of(job)
        name = str(job.metadata.name)
        if key is None or job.metadata.uid in self._removed or job.metadata.deletion_timestamp:
            return None
        known = self._jobs.get(key)
        uid = str(job.metadata.uid)
        if known is None or known.uid != uid:  # new, or a new Job under this name
            incarnation = (job.metadata.annotations or {}).get(INCARNATION_ANNOTATION)
            known = self._jobs[key] = _Job(name, uid, incarnation, RUNNING, seen_at)
            known.first_seen = time.time()
        known.seen_at = max(known.seen_at, seen_at)
        known.deadline_s, known.deadline = _deadline_of(job, known.first_seen)
        ended = _job_outcome(job)
        if ended is not None and known.state == RUNNING and not known.collecting:
            known.collecting = True
            task = asyncio.get_running_loop().create_task(self._collect(key, known, ended))
            self._collecting.add(task)
            task.add_done_callback(self._collecting.discard)
        return key

    async def _end_overdue_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for key, job in list(self._jobs.items()):
                overdue = job.deadline is not None and now > job.deadline + self.deadline_grace_s
                if overdue and job.state == RUNNING and not job.collecting:
                    job.collecting = True
                    task = asyncio.get_running_loop().create_task(self._end_overdue(key, job))
                    self._collecting.add(task)
                    task.add_done_callback(self._collecting.discard)

    async def _end_overdue(self, key: Key, job: _Job) -> None:
        """The Job controller missed this Job's deadline: its log is kept, the Job deleted (its
        pods go too), and the attempt timed out."""
        log.warning(
            "Job %s/%s is still running %g s past its %s s deadline: deleting it",
            self.namespace,
            job.name,
            self.deadline_grace_s,
            job.deadline_s,
        )
        detail = (
            f"timed out after {job.deadline_s} s (the Job controller had not ended the Job "
            f"{self.deadline_grace_s:g} s later: deleted by the reins controller)"
        )
        await self._collect(key, job, Ended("timeout", None, detail))
        self.overdue_jobs += 1
        self._removed.add(job.uid)  # its late events (the deletion's) are not a new outcome
        try:
            await asyncio.to_thread(
                self._batch.delete_namespaced_job,
                job.name,
                self.namespace,
                body={"preconditions": {"uid": job.uid}},
                propagation_policy="Background",
            )
        except ApiException as error:
            if error.status not in (404, 409):
                log.warning("deleting overdue Job %s failed: %s", job.name, _api_message(error))
        except (urllib3.exceptions.HTTPError, OSError) as error:
            log.warning("deleting overdue Job %s failed: %r", job.name, error)

    def _gone(self, key: Key, job: _Job) -> None:
        job.state = Ended("lost", None, f"Job {self.namespace}/{job.name} was deleted")
        job.log = AgentLog(path=f"k8s://{self.namespace}/jobs/{job.name}", tail="")
        self._on_change()

    async def _collect(self, key: Key, job: _Job, ended: Ended) -> None:
        """Exit code and log tail of a finished Job's pod, then the Job counts as ended."""
        try:
            exit_code, text, where = await asyncio.wait_for(
                asyncio.to_thread(self._pod_details, job.name), 20
            )
        except Exception as error:  # the outcome stands without the details
            exit_code, text, where = None, f"(no pod details: {error!r})", ""
        path = f"k8s://{self.namespace}/jobs/{job.name}"
        if self.log_dir is not None and text:
            file = self.log_dir / key[0] / f"attempt-{key[1]}.log"
            with contextlib.suppress(OSError):
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_text(text)
                path = str(file)
        if ended.outcome == "crashed" and exit_code is not None:
            ended = Ended("crashed", exit_code, f"exited with status {exit_code} ({where})")
        job.log = AgentLog(path=path, tail=text[-TAIL_BYTES:])
        if job.state == RUNNING and self._jobs.get(key) is job:
            job.state = ended
            self._on_change()

    def _pod_details(self, job_name: str) -> tuple[int | None, str, str]:
        """The last pod's container exit code, its log (best effort), and its name."""
        pods = self._core.list_namespaced_pod(
            self.namespace, label_selector=f"job-name={job_name}", _request_timeout=10
        ).items
        if not pods:
            return None, "(the Job has no pod left)", ""
        pod = max(pods, key=lambda p: p.metadata.creation_timestamp)
        exit_code = None
        for status in pod.status.container_statuses or []:
            terminated = status.state.terminated if status.state else None
            if terminated is not None and terminated.exit_code is not None:
                exit_code = int(terminated.exit_code)
                if exit_code != 0:
                    break
        try:
            text = str(
                self._core.read_namespaced_pod_log(
                    pod.metadata.name,
                    self.namespace,
                    tail_lines=200,
                    limit_bytes=64 * 1024,
                    _request_timeout=10,
                )
            )
        except ApiException as error:
            text = f"(no log from pod {pod.metadata.name}: {_api_message(error)})"
        return exit_code, text, f"pod {pod.metadata.name}"


class _RateLimiter:
    """At most `rate` acquisitions per second, in bursts of up to `rate` (a token bucket)."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"the Job creation rate must be positive, not {rate}")
        self.rate = rate
        self.capacity = max(1.0, rate)
        self._tokens = self.capacity
        self._at = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
                self._at = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await asyncio.sleep((1 - self._tokens) / self.rate)


def _child(parent: dict[str, Any], name: str) -> dict[str, Any]:
    """`parent[name]` as a mapping, created when absent or empty (`metadata:` alone is None)."""
    value = parent.get(name)
    if not isinstance(value, dict):
        if value is not None:
            raise LaunchError(f"the template's `{name}` must be a mapping, not {value!r}")
        value = parent[name] = {}
    return value


def _job_outcome(job: Any) -> Ended | None:
    """What a finished Job's conditions say; None while it runs."""
    status = job.status
    for condition in (status.conditions if status else None) or []:
        if condition.status != "True":
            continue
        if condition.type == "Complete":
            return Ended("succeeded", 0, "completed")
        if condition.type == "Failed":
            message = f"{condition.reason}: {condition.message}"
            if condition.reason == "DeadlineExceeded":
                deadline = job.spec.active_deadline_seconds
                return Ended("timeout", None, f"timed out after {deadline} s ({message})")
            return Ended("crashed", None, f"failed ({message})")
    return None


def _deadline_of(job: Any, first_seen: float) -> tuple[int | None, float | None]:
    """A Job's `activeDeadlineSeconds`, and when they run out: counted, as the Job controller
    counts them, from its start time (its creation until the Job controller sets that), and
    never before they ran out since this controller first saw the Job: the apiserver's clock may
    be behind this machine's, and a Job ended early is a rollout's work lost."""
    seconds = job.spec.active_deadline_seconds if job.spec is not None else None
    if seconds is None:
        return None, None
    started = (job.status.start_time if job.status is not None else None) or (
        job.metadata.creation_timestamp
    )
    by_apiserver = started.timestamp() if started is not None else first_seen
    return int(seconds), max(by_apiserver, first_seen) + seconds


def _key_of(job: Any) -> Key | None:
    annotations = job.metadata.annotations or {}
    labels = job.metadata.labels or {}
    rollout_id = annotations.get(ROLLOUT_ANNOTATION)
    attempt = labels.get(ATTEMPT_LABEL)
    if not rollout_id or not attempt or not str(attempt).isdigit():
        return None
    return (str(rollout_id), int(attempt))


_SETTINGS_REFUSED = (401, 403, 404)
"""The API's answers that say the settings are wrong (credentials, RBAC, the namespace)."""


def _deadline_s(timeout_s: float | None) -> int | None:
    """A Job's `activeDeadlineSeconds` for a timeout: whole seconds, at least 1, within int64
    (a timeout of 1e19 s was refused by the apiserver as the template's fault); none for no
    timeout or an infinite one (`--timeout inf` was retried for ever: no int is infinite)."""
    if not timeout_s or not math.isfinite(timeout_s):
        return None
    return min(max(1, math.ceil(timeout_s)), 2**63 - 1)


def _objects(parent: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """`parent[key]`, a list of objects, or a `LaunchError` saying what the template has there
    (an AttributeError, retried for ever, otherwise)."""
    items = parent.get(key)
    if items is None:
        return []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise LaunchError(f"the Job template's `{key}` must be a list of objects, not {items!r}")
    return items


def _object_name(prefix: str, text: str) -> str:
    """`prefix` + `text` as a Kubernetes object name (63 lower-case [a-z0-9-]), with a digest of
    `text` when it had to change: `Team` and `team`, or two long names alike, stay apart."""
    clean = _NAME_UNSAFE.sub("-", text.lower()).strip("-")
    name = f"{prefix}{clean}"
    if clean != text or len(name) > 63:
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        name = f"{name[: 63 - 9].rstrip('-')}-{digest}"
    return name


def _label_value(text: str) -> str:
    """A valid label value (63 characters of [A-Za-z0-9_.-], alphanumeric at both ends)."""
    value = _LABEL_UNSAFE.sub("-", text).strip("-_.")
    if value != text or len(value) > 63:
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        value = f"{value[:54].strip('-_.')}-{digest}".strip("-")
    return value


def _api_message(error: ApiException) -> str:
    body = getattr(error, "body", None)
    if body:
        with contextlib.suppress(ValueError, TypeError, yaml.YAMLError):
            parsed = yaml.safe_load(body)
            if isinstance(parsed, dict) and parsed.get("message"):
                return f"{error.status} {parsed['message']}"
    return f"{error.status} {error.reason}"
