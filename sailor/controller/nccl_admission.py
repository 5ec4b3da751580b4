"""One NCCL version per job: which registered nodes a layout may not use because their torch
build carries another NCCL than the job's.

Every CUDA build of torch bundles its own NCCL (torch 2.13.0: NCCL 2.29.3 in the CUDA 12.6
build, 2.29.7 in the CUDA 13.0 one on PyPI), and NCCL promises nothing for the ranks of one
communicator running different versions (its API is compatible within a major version, its
protocol between ranks is not documented as such; its maintainers suspect mixed versions
across nodes first when a job hangs, NVIDIA/nccl#354): a job whose nodes mix builds may
fail or hang at a collective, far from the cause. The agent registers its node's build
(``NodeSpec.runtime``, from its node check); this module picks the job's version and names
the nodes of any other.

The rule, the simplest that never disturbs a running layout:

* the candidates are the registered nodes no other rule keeps out (excluded, held, under a
  preemption notice), and only those whose NCCL version is known count;
* the job's version is the one with the most GPUs among the *placed* nodes still registered
  (the layout running, or the last one), then the most GPUs among all candidates, then the
  newer version: a node of another build that joins a running job waits outside it, while a
  job with no layout left goes to the version of most GPUs;
* a node of another version is not admitted, with the reason; a node of unknown version (a
  CPU node, an agent whose check gathered nothing or of an older release) is not judged.

Pure: no I/O, no clock; inputs never modified. Called by ``decide.unusable`` (so ``decide``,
the daemon and ``sailor status`` see the same nodes out) and by ``controller/status.py``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from sailor.schemas.hardware import NodeSpec

__all__ = ["job_nccl", "not_admitted"]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def _nccl(node: NodeSpec) -> str:
    return node.runtime.nccl_version if node.runtime is not None else ""


def job_nccl(
    placement: Collection[str], nodes: Mapping[str, NodeSpec], candidates: Collection[str]
) -> str | None:
    """The NCCL version the job's layouts use (None: no candidate has a known one);
    ``placement``: the nodes of the job's layout (``DesiredState.placement``)."""
    placed: dict[str, int] = {}
    total: dict[str, int] = {}
    for n in candidates:
        spec = nodes.get(n)
        v = _nccl(spec) if spec is not None else ""
        if spec is None or not v:
            continue
        total[v] = total.get(v, 0) + spec.gpus
        if n in placement:
            placed[v] = placed.get(v, 0) + spec.gpus
    if not total:
        return None
    return max(total, key=lambda v: (placed.get(v, 0), total[v], _key(v), v))


def not_admitted(
    placement: Collection[str], nodes: Mapping[str, NodeSpec], candidates: Collection[str]
) -> dict[str, str]:
    """The ``candidates`` whose NCCL version is not the job's, each with the reason (for the
    audit log and ``sailor status``); empty when every known version agrees."""
    job = job_nccl(placement, nodes, candidates)
    if job is None:
        return {}
    same = [nodes[n] for n in sorted(candidates) if n in nodes and _nccl(nodes[n]) == job]
    build = _build(same[0]) if same else ""
    out: dict[str, str] = {}
    for n in sorted(candidates):
        spec = nodes.get(n)
        if spec is None or spec.runtime is None or not _nccl(spec) or _nccl(spec) == job:
            continue
        out[n] = (
            f"NCCL {_nccl(spec)} ({_build(spec)}), the job's nodes run NCCL {job} ({build}, "
            f"{', '.join(x.node_id for x in same[:5])}{', ...' if len(same) > 5 else ''}): "
            "one communicator should run one NCCL version; install the job's torch build on it "
            "(SAILOR_TORCH_INDEX, docs/gpu.md) and restart its agent"
        )
    return out


def _build(spec: NodeSpec) -> str:
    r = spec.runtime
    if r is None:
        return "unknown build"
    return f"torch {r.torch_version or '?'}, CUDA {r.torch_cuda or 'none'}"
