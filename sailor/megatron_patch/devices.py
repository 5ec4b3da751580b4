"""Which communication backend a job uses and which device each of its ranks runs on (pure).

The backend is a decision made from the plan, not from what the host happens to have: a
plan on CPU replica groups (``cpu`` or a CPU kind ``cpu-<kind>``: ``is_cpu_type``) runs on
gloo even where CUDA is visible (the CPU test suite on a GPU host), a plan on GPU types runs
on NCCL and refuses to start where CUDA is missing (run it on CPU only by asking for gloo).
An explicit ``--backend`` overrides the default within those rules.

A rank of a GPU plan uses GPU ``replica.first_gpu + tp_rank`` of its node (the controller's
placement sets ``first_gpu``; :func:`pack_one_host` does it for a plan launched on one
machine). NCCL needs one GPU per process: :func:`check_devices` refuses two ranks of a node
on one GPU, or a GPU the node does not have, naming the pipelines, stages and ranks.

:func:`nccl_error_env` is how a dead or silent peer becomes a Python exception instead of
the watchdog's ``SIGABRT`` (see its docstring); :func:`nccl_env` adds to it what keeps NCCL
to what the cost model prices (no NVLink SHARP), and :func:`cuda_alloc_env` the caching
allocator's expandable segments, which :func:`worker_env` puts in the environment a worker
process is started with (the agent's supervisor and ``launch_local``). Nothing here imports
torch or touches a device; the worker and the DeepSpeed adapter apply the decisions (the
user's own settings always win).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

__all__ = [
    "Backend",
    "DeviceMappingError",
    "backend_for",
    "check_devices",
    "check_rank_device",
    "choose_backend",
    "cuda_alloc_env",
    "device_of",
    "local_device",
    "nccl_env",
    "nccl_error_env",
    "pack_one_host",
    "worker_env",
]

Backend = Literal["gloo", "nccl"]


class DeviceMappingError(ValueError):
    """The plan's backend or GPUs do not fit this host (a configuration error: not retryable
    on the same host and plan)."""


def backend_for(plan: Plan) -> Backend:
    """The default backend of ``plan``: gloo for a plan on CPU replica groups (``cpu`` and CPU
    kinds, mixed as they like), NCCL for a plan on GPUs; a plan mixing CPUs and GPUs is
    refused (one backend per job)."""
    kinds = {is_cpu_type(s.replica.gpu_type) for p in plan.pipelines for s in p.stages}
    if kinds == {True}:
        return "gloo"
    if kinds == {False}:
        return "nccl"
    types = sorted({s.replica.gpu_type for p in plan.pipelines for s in p.stages})
    raise DeviceMappingError(
        f"plan {plan.plan_id!r} mixes cpu and GPU replica groups ({', '.join(types)}): "
        "one job runs on one backend"
    )


def choose_backend(plan: Plan, requested: str | None, cuda_available: bool) -> Backend:
    """The backend to run ``plan`` with: ``requested`` if given, else :func:`backend_for`.

    gloo may run a GPU plan on CPU (tests, a dry run); NCCL needs CUDA and a GPU plan.
    """
    if requested not in (None, "gloo", "nccl"):
        raise DeviceMappingError(f"backend={requested!r}: use 'gloo' or 'nccl'")
    default = backend_for(plan)
    backend: Backend = "gloo" if requested == "gloo" else default
    if requested == "nccl" and default == "gloo":
        raise DeviceMappingError(
            f"backend='nccl' but plan {plan.plan_id!r} runs on cpu replica groups: NCCL needs GPUs"
        )
    if backend == "nccl" and not cuda_available:
        types = sorted({s.replica.gpu_type for p in plan.pipelines for s in p.stages})
        raise DeviceMappingError(
            f"plan {plan.plan_id!r} runs on GPUs ({', '.join(types)}) with NCCL, but CUDA is "
            "not available here; pass backend 'gloo' (--backend gloo) to run it on the CPU"
        )
    return backend


def local_device(plan: Plan, rank: int) -> int:
    """The node-local GPU index of ``rank``: its replica group's ``first_gpu`` + TP rank."""
    _rank_of(plan, rank)  # a rank outside the plan: the engine's own error
    return plan.local_gpu(rank)


def _rank_of(plan: Plan, rank: int) -> tuple[int, int, int]:
    ranks = plan.ranks()
    if not 0 <= rank < len(ranks):
        raise DeviceMappingError(f"rank={rank}: the plan has ranks 0..{len(ranks) - 1}")
    return ranks[rank]


def device_of(plan: Plan, rank: int, backend: str) -> str:
    """``"cpu"`` under gloo, else ``"cuda:N"`` with N = :func:`local_device`."""
    if backend != "nccl":
        return "cpu"
    return f"cuda:{local_device(plan, rank)}"


def _where(pi: int, si: int, first: int, tp: int) -> str:
    ranks = f"rank {first}" if tp == 1 else f"ranks {first}..{first + tp - 1}"
    return f"pipelines[{pi}].stages[{si}] ({ranks})"


def check_devices(plan: Plan, device_count: int, node: str | None = None) -> None:
    """Refuse a GPU mapping NCCL cannot run: a GPU index the host does not have, or one GPU
    used by two ranks.

    ``node=None`` checks every replica group as if on this one host (a local launch);
    otherwise only the groups placed on ``node`` (a worker checks its own node).
    """
    owner: dict[int, str] = {}
    rank = 0
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            r = s.replica
            first_rank, rank = rank, rank + r.tp
            if node is not None and r.node_id != node:
                continue
            where = _where(pi, si, first_rank, r.tp)
            if r.first_gpu + r.tp > device_count:
                raise DeviceMappingError(
                    f"{where} needs cuda:{r.first_gpu}..cuda:{r.first_gpu + r.tp - 1} "
                    f"(first_gpu={r.first_gpu}, tp={r.tp}), but this host has "
                    f"{device_count} GPU(s)"
                )
            for g in range(r.first_gpu, r.first_gpu + r.tp):
                if g in owner:
                    host = f"node {node!r}" if node is not None else "this host"
                    raise DeviceMappingError(
                        f"cuda:{g} on {host} is given to {owner[g]} and to {where}: NCCL needs "
                        "one GPU per rank; set first_gpu so the replica groups of a node do "
                        "not overlap"
                    )
                owner[g] = where


def check_rank_device(plan: Plan, rank: int, device_count: int) -> None:
    """What one rank checks before it takes its GPU: its replica group fits the node's
    ``device_count`` GPUs and, when the plan says which node it is on (``node_id``), no other
    group placed on that node shares a GPU with it or with each other.

    An unplaced plan (no ``node_id``) says nothing about which ranks share a host; its
    launcher checks that (``launch_local``: :func:`check_devices` over all ranks), and NCCL
    itself refuses two ranks of one communicator on one GPU at its first collective.
    """
    pi, si, _t = _rank_of(plan, rank)
    r = plan.pipelines[pi].stages[si].replica
    if r.node_id:
        check_devices(plan, device_count, node=r.node_id)
    elif r.first_gpu + r.tp > device_count:
        first = sum(1 for x in plan.ranks() if (x[0], x[1]) < (pi, si))
        raise DeviceMappingError(
            f"{_where(pi, si, first, r.tp)} needs cuda:{r.first_gpu}..cuda:"
            f"{r.first_gpu + r.tp - 1} (first_gpu={r.first_gpu}, tp={r.tp}), but this host has "
            f"{device_count} GPU(s)"
        )


def pack_one_host(plan: Plan) -> Plan:
    """``plan`` with its replica groups on consecutive GPUs of one host, in rank order.

    For a plan launched on one machine that was never placed (every ``node_id`` empty and
    every ``first_gpu`` 0): without it every TP-1 rank would use ``cuda:0``. A plan that
    was placed is returned unchanged (:func:`check_devices` then judges it).
    """
    groups = [s.replica for p in plan.pipelines for s in p.stages]
    if any(r.node_id or r.first_gpu for r in groups):
        return plan
    total = sum(r.tp for r in groups)
    nxt = 0
    pipelines: list[Pipeline] = []
    for p in plan.pipelines:
        stages: list[Stage] = []
        for s in p.stages:
            data = s.replica.model_dump()
            data.update(first_gpu=nxt, gpus_per_node=max(total, s.replica.gpus_per_node))
            nxt += s.replica.tp
            stages.append(s.model_copy(update={"replica": ReplicaGroup(**data)}))
        pipelines.append(p.model_copy(update={"stages": tuple(stages)}))
    return plan.model_copy(update={"pipelines": tuple(pipelines)})


def nccl_error_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to add before an NCCL process group starts, so that a dead or silent
    peer surfaces as a Python exception the worker reports (the user's own settings win).

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: torch's default (3, "tear down without aborting the
    communicator") makes the watchdog ``std::abort`` the process when a collective times out
    — a ``SIGABRT`` from a C++ thread, no Python exception, no error file. Mode 2 ("only abort
    the NCCL communicator") aborts the communicator and keeps the process: the hung kernels
    return and the next operation on the aborted communicator raises in the calling thread,
    where the worker writes its error file and exits at once (it never trains on after an
    error, so the data a failed collective left behind is never used). Sources: PyTorch's
    "ProcessGroupNCCL Environment Variables" page (torch 2.13 as installed: default 3);
    pytorch/pytorch#84386 (mode 2: abort collectives and communicators, keep the process).

    The bet and its fallback: mode 3 exists because ``ncclCommAbort`` itself can hang with
    some NCCL versions (pytorch/pytorch#102599). If it hangs here, the watchdog's heartbeat
    monitor (on by default) aborts the process after its heartbeat timeout, and the parent's
    record below still reports it, later. Whether mode 2 raises promptly on a real NCCL
    timeout is for a GPU run to confirm (``tests/gpu/test_launch_nccl.py``).

    ``TORCH_NCCL_BLOCKING_WAIT`` is left off: it would make every collective block the host
    until the GPU finishes (the documented performance cost). The parent process still
    writes a record for a rank killed by a signal (``errors.signal_failure_record``): the
    watchdog's heartbeat monitor can abort a process whose watchdog is stuck.
    """
    out: dict[str, str] = {}
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in environ:
        out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    return out


def nccl_env(environ: Mapping[str, str], conf: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment to add before an NCCL process group starts: the error handling
    of :func:`nccl_error_env`, and NVLink SHARP off (the user's own settings win, and so do
    those of NCCL's configuration files, ``conf``: ``nccl_conf.read_nccl_conf``).

    ``NCCL_NVLS_ENABLE=0``: on NVSwitch systems (H100/H200 SXM, GH200 NVL) NCCL turns NVLink
    SHARP on by itself (NVLS arrived in NCCL 2.17; the variable's documented default enables
    it wherever the hardware supports it), and its buffers come on top of the communicator's
    usual ones, per communicator, at its initialisation: with eager initialisation
    (``device_id``: every group the plan builds connects when it is created) each
    intra-node group of a rank can take them. The memory model prices a communicator without them
    (``catalog/calibration.json``, ``communicator_bytes``: "Not counted: NVLink SHARP
    buffers"), so a plan sized to the prior could fail at communicator init with an OOM on
    exactly the GPUs it was planned for. With it off the engine does what the cost model
    prices; what NVLS would speed up is the all-reduce of large messages within a node, which
    the planner's collective model does not assume either. A user who sets
    ``NCCL_NVLS_ENABLE`` (to 1, to measure it) keeps their value, and the memory margin is
    then theirs to check.

    NCCL takes its configuration files' settings only for variables the environment does
    not set (:mod:`~sailor.megatron_patch.nccl_conf`): the variable added here would
    override an administrator's ``NCCL_NVLS_ENABLE`` in ``/etc/nccl.conf`` (or the user's
    in ``~/.nccl.conf`` / ``$NCCL_CONF_FILE``). Given ``conf``, a file's setting of it is
    left to apply instead."""
    out = nccl_error_env(environ)
    if "NCCL_NVLS_ENABLE" not in environ and "NCCL_NVLS_ENABLE" not in (conf or {}):
        out["NCCL_NVLS_ENABLE"] = "0"
    return out


def cuda_alloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The caching allocator's settings for every worker, to add before CUDA initialises
    (it reads them once, at its first use): expandable segments, unless the user configured
    the allocator themselves (``PYTORCH_CUDA_ALLOC_CONF``, or the device-generic
    ``PYTORCH_ALLOC_CONF`` of newer torch: either wins, whole).

    Why every worker, and not only the in-place ones: without them the allocator carves
    fixed segments (``cudaMalloc`` of 2 MiB or of the request's size) and ``empty_cache``
    returns only segments with no live block in them. A rank whose live tensors change over
    its life — an in-place relayout above all (receive buffers, full tensors and new
    parameters allocated between the old stage's freed blocks, after the memory verdict was
    taken on totals: ``in_place_steps.fill_stage``), but also a checkpoint snapshot, a
    resumed optimizer's moments, evaluation's activations — can then fail an allocation with
    enough free bytes in total. Expandable segments map physical pages into one growing
    virtual range per stream and pool, so freed pages are reused whatever their neighbours
    and unmapped pages go back to the device (PyTorch's CUDA semantics page, "Optimizing
    memory usage with PYTORCH_CUDA_ALLOC_CONF"; NVIDIA's Megatron-Bridge memory-tuning notes
    name it the first fix for fragmentation OOMs in training). The engine shares no CUDA
    tensor between processes (CUDA IPC, where older torch releases did not support
    expandable segments), and CPU workers never read it."""
    if "PYTORCH_CUDA_ALLOC_CONF" in environ or "PYTORCH_ALLOC_CONF" in environ:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The whole environment to start a worker process with: ``environ`` and the caching
    allocator's settings (:func:`cuda_alloc_env`; the user's own win, whole).

    Set by the parent, before the child's Python starts, they are in place before anything
    in the child can touch CUDA: the allocator reads them once, at its first use, and one
    early allocation (an import that builds a CUDA tensor, a library probing the device)
    would otherwise fix the allocator without them, silently. The worker still adds them to
    its own environment (and the allocator's, ``rank_main``) for a worker started by hand.
    """
    return {**environ, **cuda_alloc_env(environ)}
