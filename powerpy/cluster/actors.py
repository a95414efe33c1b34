"""Pipeline stages as Ray actors (``pip install 'powerpy[cluster]'``).

:func:`start_pipeline` connects to the Ray cluster (``ray.init()``: the one ``ray start`` made,
or a new local one), pins each stage to its node, waits for it to load its layers from that
node's copy of the model (checked against the driver's digest) and returns the
``PipelineEngine`` over them. Hidden states go from actor to actor as Ray objects; the driver
only waits. Each actor answers ``ping`` on its own thread (a concurrency group), so the
liveness probe is answered while a forward runs. With ``restart`` Ray restarts a dead stage
(``max_restarts``) and the engine re-runs its sequences.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from powerpy.cluster.pipeline import PipelineEngine, StageDown
from powerpy.cluster.plan import Node, this_node
from powerpy.cluster.spec import StageSpec
from powerpy.cluster.stage import Call, Stage
from powerpy.config import ModelArgs
from powerpy.formats.gguf_reader import read_gguf
from powerpy.model.options import RunOptions
from powerpy.model.stage import layer_span, stage_file
from powerpy.tokenizer import Tokenizer

log = logging.getLogger(__name__)

POLL = 0.2  # seconds between looks at an abort flag while waiting
STANDARD_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}
NAMESPACE = "powerpy"  # the stage actors' (named "pipeline-<id>-stage<i>")


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at ``address`` (default: ``RAY_ADDRESS``, else the one ``ray
    start`` made on this machine, else a new local one, as ``ray.init()`` does)."""
    if not ray.is_initialized():
        ray.init(address=address)


@ray.remote(concurrency_groups={"control": 1})
class StageActor:
    """A ``Stage`` in a Ray worker. A stage that fails to load stays up to say why."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stage: Stage | None = None
        self.error: str | None = None
        try:
            self.stage = Stage(*args, **kwargs)
        except Exception as e:  # reported by info(): one clear line, not an actor crash
            self.error = f"{type(e).__name__}: {e}"

    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        where = {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}
        if self.stage is None:
            return {"error": self.error, **where}
        return {**self.stage.info(), **where, "host": where["ip"]}

    def run(self, call: Call, x: Any = None) -> Any:
        assert self.stage is not None
        return self.stage.run(call, x)

    @ray.method(concurrency_group="control")
    def ping(self) -> dict[str, Any]:
        if self.stage is None:
            raise RuntimeError(self.error)
        return self.stage.ping()


class RayTransport:
    """The calls of a ``PipelineEngine`` as Ray actor tasks (``pipeline.Transport``).

    ``starts[i]`` is how stage i's actor is made (options, arguments): a stage Ray cannot
    restart (killed for good, or its node gone) is made again."""

    def __init__(self, starts: list[tuple[dict, tuple, dict]]) -> None:
        self.starts = starts
        self.actors = [self._start(i) for i in range(len(starts))]
        self.infos: list[dict[str, Any]] = []

    def _start(self, index: int) -> Any:
        options, args, kwargs = self.starts[index]
        return StageActor.options(**options).remote(*args, **kwargs)

    def submit(self, index: int, call: Call, prev: Any) -> Any:
        return self.actors[index].run.remote(call, prev)

    def gather(self, chains, timeout, abort):
        deadline = time.monotonic() + timeout
        pending = [chain[-1] for chain in chains]
        while pending and not abort():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, POLL))
        late = set(pending)
        return [self._outcome(chain, chain[-1] in late, timeout) for chain in chains]

    def _outcome(self, chain: list[Any], late: bool, timeout: float) -> Any:
        """The chain's result, the exception a stage raised, or the stage that is down."""
        if late:  # the first stage whose call has not finished is the stuck one
            for i, ref in enumerate(chain):
                if not ray.wait([ref], timeout=0)[0]:
                    return StageDown(i, f"no answer within {timeout:g} s", timed_out=True)
        try:
            return ray.get(chain[-1], timeout=0)
        except RayActorError as e:  # also when an earlier stage died: its error travels on
            return StageDown(self._index(e, len(chain) - 1), _first_line(e))
        except RayTaskError as e:  # the stage's own exception (or an earlier stage's)
            cause = getattr(e, "cause", None)
            return cause if isinstance(cause, Exception) else RuntimeError(_first_line(e))
        except GetTimeoutError:
            return StageDown(len(chain) - 1, f"no answer within {timeout:g} s", timed_out=True)

    def _index(self, e: RayActorError, default: int) -> int:
        actor = getattr(e, "actor_id", None)
        for i, a in enumerate(self.actors):
            if actor is not None and a._actor_id.hex() == actor:
                return i
        return default

    def ping(self, timeout: float) -> list[dict[str, Any] | StageDown]:
        refs = [a.ping.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: list[dict[str, Any] | StageDown] = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=0))
            except GetTimeoutError:
                out.append(StageDown(i, f"no answer to the probe within {timeout:g} s", True))
            except (RayActorError, RayTaskError) as e:
                out.append(StageDown(i, _first_line(e)))
        return out

    def recover(self, index: int, timeout: float, stuck: bool = False) -> dict[str, Any]:
        actor, deadline = self.actors[index], time.monotonic() + timeout
        if stuck:  # alive but not answering: make Ray restart it
            ray.kill(actor, no_restart=False)
        while True:  # calls wait while Ray restarts the actor and it loads its layers again
            try:
                info = ray.get(actor.info.remote(), timeout=max(0.1, deadline - time.monotonic()))
                break
            except GetTimeoutError:
                raise TimeoutError(f"it did not load again within {timeout:g} s") from None
            except RayActorError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(_first_line(e)) from None
                if isinstance(e, ActorDiedError):  # for good: start it anew on its node
                    log.warning(
                        "stage %d is gone for good (%s): starting it again", index, _first_line(e)
                    )
                    actor = self.actors[index] = self._start(index)
                else:  # restarting
                    time.sleep(POLL)
        if info.get("error"):
            raise RuntimeError(info["error"])
        return info

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


def start_pipeline(
    path: str | os.PathLike[str],
    specs: Sequence[StageSpec],
    *,
    load_options: dict[str, Any] | None = None,
    vram_budget: float | None = None,
    threads: int = 0,
    timeout: float = 120.0,
    load_timeout: float = 1800.0,
    restart: bool = False,
    address: str | None = None,
) -> PipelineEngine:
    """Start one Ray actor per stage and return the engine over them.

    Args:
        path: the model; the driver's copy gives each stage's digest, and every node must hold
            the same file at the same path.
        specs: the stages (``spec.parse_pipeline`` or ``plan.plan_pipeline``).
        load_options: keywords of ``powerpy.load`` for every stage.
        vram_budget: GiB of VRAM for a stage whose spec names none (None: CPU only).
        threads: torch threads per stage (0: the CPUs Ray gives the stage).
        timeout: seconds a step may take (``PipelineEngine``).
        load_timeout: seconds a stage may take to load (and to load again after a restart).
        restart: let Ray restart a dead stage; the engine then re-runs its sequences.
        address: the Ray cluster (see :func:`connect`).

    Raises:
        ValueError: a host no node matches, or a stage that failed to load (the message names
            the stage, its node and the error).
        TimeoutError: a stage did not load within ``load_timeout``.
    """
    connect(address)
    load_options = dict(load_options or {})
    with read_gguf(path) as gf:
        args = ModelArgs.from_gguf(gf)
        digests = [stage_file(gf, s.layers, args).digest() for s in specs]
        tokenizer = Tokenizer.from_gguf_kv(gf.kv)
    args = args.with_ffn_act(load_options.get("ffn_act"), source=str(path))
    nodes = {id(s): node_for(s.host) for s in specs}
    run_id = f"pipeline-{uuid.uuid4().hex[:8]}"
    shares: dict[str | None, int] = {}
    for s in specs:
        shares[nodes[id(s)]] = shares.get(nodes[id(s)], 0) + 1
    starts = []
    for i, s in enumerate(specs):
        node = nodes[id(s)]
        budget = s.vram_budget if s.vram_budget is not None else vram_budget
        opts = dict(load_options, vram_budget=budget)
        device = str(opts.get("device") or "cuda")  # "cpu": the emulated accelerator
        gpu = budget is not None and device.startswith("cuda") and _node_has(node, "GPU")
        cpus = max(1, int(_node_has(node, "CPU") // shares[node]))
        options: dict[str, Any] = dict(
            num_cpus=cpus,
            num_gpus=1 if gpu else 0,
            max_restarts=-1 if restart else 0,
            max_task_retries=0,
            name=f"{run_id}-stage{i}",  # ray.get_actor(name, namespace=NAMESPACE)
            namespace=NAMESPACE,
        )
        if node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        kwargs = dict(index=i, digest=digests[i], threads=threads or cpus, load_options=opts)
        starts.append((options, (str(path), s.layers), kwargs))
    transport = RayTransport(starts)
    transport.infos = infos = _loaded(transport.actors, specs, load_timeout)
    for i, info in enumerate(infos):
        info["actor"] = f"{run_id}-stage{i}"
    for i, info in enumerate(infos):
        log.info(
            "stage %d: layers %s on %s, loaded in %.1f s",
            i,
            info["layers"],
            info["host"],
            info["load_seconds"],
        )
    run = RunOptions(sparse=not load_options.get("dense", False))
    return PipelineEngine(
        transport,
        args,
        run,
        timeout=timeout,
        restart=restart,
        restart_timeout=load_timeout,
        tokenizer=tokenizer,
    )


def _loaded(actors: list[Any], specs: Sequence[StageSpec], timeout: float) -> list[dict]:
    refs = [a.info.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    infos, problems = [], []
    for i, (ref, s) in enumerate(zip(refs, specs, strict=True)):
        where = f"stage {i} (layers {layer_span(s.layers)} on {s.host or 'any node'})"
        if ref not in ready:
            problems.append(
                f"{where} did not load within {timeout:g} s (is there a node with "
                "free CPUs and GPUs for it?)"
            )
            continue
        try:
            info = ray.get(ref)
        except RayActorError as e:
            problems.append(f"{where} died while loading: {_first_line(e)}")
            continue
        if info.get("error"):
            problems.append(f"{where} on {info.get('ip')}: {info['error']}")
        infos.append(info)
    if problems:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise (TimeoutError if "did not load" in problems[0] else ValueError)("; ".join(problems))
    return infos


def node_for(host: str | None) -> str | None:
    """The id of the one alive Ray node ``host`` names (its IP, hostname, node id or a custom
    resource of its own); None for any node.

    Raises:
        ValueError: no node or several nodes match.
    """
    if host is None:
        return None
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    found = [n["NodeID"] for n in nodes if _names(n, host)]
    if len(found) == 1:
        return found[0]
    known = ", ".join(sorted({n["NodeManagerAddress"] for n in nodes}))
    if not found:
        raise ValueError(
            f"--pipeline: no Ray node is {host!r} (the cluster's nodes: {known}); name a node "
            "by IP, hostname, node id or a resource of its own"
        )
    raise ValueError(
        f"--pipeline: {len(found)} Ray nodes match {host!r}; name one by a resource of its own "
        "(ray start --resources='{\"pc2\": 1}')"
    )


def _names(node: dict[str, Any], host: str) -> bool:
    own = set(node.get("Resources", {})) - STANDARD_RESOURCES
    own = {r for r in own if not r.startswith("node:")}
    return (
        host
        in (node.get("NodeManagerAddress"), node.get("NodeManagerHostname"), node.get("NodeID"))
        or host in own
    )


def _node_has(node: str | None, resource: str) -> float:
    """How much of ``resource`` the node has (any node: the most one has)."""
    amounts = [
        float(n.get("Resources", {}).get(resource, 0.0))
        for n in ray.nodes()
        if n.get("Alive") and (node is None or n["NodeID"] == node)
    ]
    return max(amounts, default=0.0)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return next((t.strip() for t in text if t.strip()), type(e).__name__)


def cluster_nodes() -> list[Node]:
    """The alive nodes of the Ray cluster, probed where they are (free RAM and VRAM, read
    bandwidths; ``plan.this_node``), each named as ``--pipeline`` can name it: its IP, or its
    node id where several nodes share one IP."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    ips = [n["NodeManagerAddress"] for n in nodes]
    probe = ray.remote(num_cpus=0)(this_node)
    refs = []
    for n in nodes:
        name = n["NodeManagerAddress"] if ips.count(n["NodeManagerAddress"]) == 1 else n["NodeID"]
        where = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        refs.append(probe.options(scheduling_strategy=where).remote(name))
    try:
        return ray.get(refs, timeout=300)
    except (ray.exceptions.RayError, GetTimeoutError) as e:
        raise ValueError(
            f"could not probe the Ray cluster's nodes ({_first_line(e)}): check `ray status`, "
            "or describe the machines with --nodes"
        ) from None
