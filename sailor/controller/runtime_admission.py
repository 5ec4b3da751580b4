"""One worker runtime per job: which registered nodes a layout may not use because their
torch build carries another NCCL than the job's, or their workers run another Sailor release.

Every CUDA build of torch bundles its own NCCL (torch 2.13.0: NCCL 2.29.3 in the CUDA 12.6
build, 2.29.7 in the CUDA 13.0 one on PyPI), and NCCL promises nothing for the ranks of one
communicator running different versions (its API is compatible within a major version, its
protocol between ranks is not documented as such; its maintainers suspect mixed versions
across nodes first when a job hangs, NVIDIA/nccl#354): a job whose nodes mix builds may
fail or hang at a collective, far from the cause. Every rank of a job also computes the
same things without talking, in the same code: the collectives of each step and their order
(``megatron_patch.step_agreement``), who writes which layer of a checkpoint
(``checkpoint.assignment``); workers of two releases in one world may disagree and hang, or
fail every save. A rolling upgrade (docs/operations.md) would put them there. The agent
registers its node's build and its release (``NodeSpec.runtime``: ``sailor_release``, the
package's version and a digest of its code); this module picks the job's runtime (the NCCL
version and the release) and names the nodes of any other.

The rule, the simplest that never disturbs a running layout:

* the candidates are the registered nodes no other rule keeps out (excluded, held, under a
  preemption notice), and only those whose NCCL version is known count;
* the job's runtime is the one with the most GPUs among the *placed* nodes still registered
  (the layout running, or the last one), then the most GPUs among all candidates, then the
  newer NCCL version, then the release's text: a node of another build or release that joins
  a running job waits outside it, while a job with no layout left goes to the runtime of most
  GPUs (so a rolling upgrade moves the job to the new release once the nodes still on the old
  one have left its layout: drain them together, docs/operations.md);
* a node of another runtime is not admitted, with the reason; a node of unknown NCCL version
  (a CPU node, an agent whose check gathered nothing or of an older release) is not judged;
* a node whose GPU type cannot compute in the job's precision (``DesiredState.job_precision``:
  a V100 in a bf16 job, ``schemas.precision.cannot_run``) is not admitted either: the planner
  would leave it out of every plan, so its join must not cost a reconfiguration that
  relaunches the same layout.

Pure: no I/O, no clock; inputs never modified. Called by ``decide.unusable`` (so ``decide``,
the daemon and ``sailor status`` see the same nodes out) and by ``controller/status.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping

from sailor import catalog
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.precision import Precision, cannot_run

__all__ = ["job_nccl", "job_release", "not_admitted"]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def _nccl(node: NodeSpec) -> str:
    return node.runtime.nccl_version if node.runtime is not None else ""


def _release(node: NodeSpec) -> str:
    return node.runtime.sailor_release if node.runtime is not None else ""


def _job_value(
    placement: Collection[str],
    nodes: Mapping[str, NodeSpec],
    candidates: Collection[str],
    value: Callable[[NodeSpec], str],
) -> str | None:
    """The value (NCCL version, release) of the most GPUs among the placed candidates that
    know one, then among all of them, then the newer; None when none knows one."""
    placed: dict[str, int] = {}
    total: dict[str, int] = {}
    for n in candidates:
        spec = nodes.get(n)
        v = value(spec) if spec is not None else ""
        if spec is None or not v:
            continue
        total[v] = total.get(v, 0) + spec.gpus
        if n in placement:
            placed[v] = placed.get(v, 0) + spec.gpus
    if not total:
        return None
    # "newer" by the version's numbers (a release's before its "+digest": a digest's digits
    # mean nothing), then the text, so every reader picks the same
    return max(total, key=lambda v: (placed.get(v, 0), total[v], _key(v.split("+")[0]), v))


def job_nccl(
    placement: Collection[str], nodes: Mapping[str, NodeSpec], candidates: Collection[str]
) -> str | None:
    """The NCCL version the job's layouts use (None: no candidate has a known one);
    ``placement``: the nodes of the job's layout (``DesiredState.placement``)."""
    return _job_value(placement, nodes, candidates, _nccl)


def job_release(
    placement: Collection[str], nodes: Mapping[str, NodeSpec], candidates: Collection[str]
) -> str | None:
    """The Sailor release the job's workers run (None: no candidate has a known one)."""
    return _job_value(placement, nodes, candidates, _release)


def _names(specs: list[NodeSpec]) -> str:
    return f"{', '.join(x.node_id for x in specs[:5])}{', ...' if len(specs) > 5 else ''}"


def not_admitted(
    placement: Collection[str],
    nodes: Mapping[str, NodeSpec],
    candidates: Collection[str],
    precision: Precision | None = None,
) -> dict[str, str]:
    """The ``candidates`` whose GPU type cannot compute in the job's ``precision``, whose
    NCCL version is not the job's, or whose release is not the job's among those left,
    each with the reason (for the audit log and ``sailor status``); empty when every one
    may join. A node that does not know a value is not judged by it."""
    out = _wrong_precision(nodes, candidates, precision)
    left = [n for n in sorted(candidates) if n in nodes and n not in out]
    nccl = job_nccl(placement, nodes, left)
    if nccl is not None:
        same = [nodes[n] for n in left if _nccl(nodes[n]) == nccl]
        build = _build(same[0]) if same else ""
        for n in left:
            mine = _nccl(nodes[n])
            if mine and mine != nccl:
                out[n] = (
                    f"NCCL {mine} ({_build(nodes[n])}), the job's nodes run NCCL {nccl} "
                    f"({build}, {_names(same)}): one communicator should run one NCCL "
                    "version; install the job's torch build on it (SAILOR_TORCH_INDEX, "
                    "docs/gpu.md) and restart its agent"
                )
        left = [n for n in left if n not in out]
    release = job_release(placement, nodes, left)
    if release is not None:
        same = [nodes[n] for n in left if _release(nodes[n]) == release]
        for n in left:
            mine = _release(nodes[n])
            if mine and mine != release:
                out[n] = (
                    f"Sailor {mine}, the job's nodes run Sailor {release} ({_names(same)}): "
                    "the workers of one job must run one release (the same collectives, the "
                    "same checkpoint writers); it joins once the job's nodes of the other "
                    "release have left (docs/operations.md, upgrades)"
                )
    return dict(sorted(out.items()))


def _wrong_precision(
    nodes: Mapping[str, NodeSpec], candidates: Collection[str], precision: Precision | None
) -> dict[str, str]:
    """The candidates whose GPU type cannot compute in the job's ``precision``, with why."""
    if precision is None:
        return {}
    specs = catalog.gpus()
    out: dict[str, str] = {}
    for n in sorted(candidates):
        spec = nodes.get(n)
        why = cannot_run(spec.gpu_type, specs, precision) if spec is not None else ""
        if why:
            out[n] = (
                f"{why}: the job computes in {precision} (DesiredState.job_precision, fixed at "
                "its first launch; docs/training.md, 'One precision per job')"
            )
    return out


def _build(spec: NodeSpec) -> str:
    r = spec.runtime
    if r is None:
        return "unknown build"
    return f"torch {r.torch_version or '?'}, CUDA {r.torch_cuda or 'none'}"
