"""One demo run from start to cleanup: servers, cluster, scenario, reference, report.

Owns every process and the temporary directory. Ctrl-C (SIGINT) and SIGTERM both end the
scenario at once and run the same cleanup as a normal exit: SIGTERM to the agents (they stop
their workers) and the controller, then the servers, then SIGKILL to anything left that
carries the run's marker (workers orphaned by the killed agent included), then the temporary
directory goes. Signals are ignored while cleaning up, so a second Ctrl-C cannot leave half.
A SIGKILL of the demo itself cannot be handled; its children then outlive it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live

from sailor.cli.demo.cluster import CONTROLLER, DemoCluster, node_names, run_job
from sailor.cli.demo.kinds import demo_kinds, write_prior
from sailor.cli.demo.layouts import layouts
from sailor.cli.demo.model import CORPUS, prepare_demo
from sailor.cli.demo.processes import ProcessRegistry
from sailor.cli.demo.reconfig import reconfigurations
from sailor.cli.demo.report import (
    compare_losses,
    loss_tolerance,
    print_summary,
    summary,
)
from sailor.cli.demo.scenario import DemoSettings, Scenario
from sailor.cli.demo.servers import start_servers
from sailor.controller.config import OnlineCalibrationSettings

__all__ = ["KEPT_RUN_DIR", "Interrupted", "run_demo"]

KEPT_RUN_DIR = "sailor demo: run directory kept: "
"""What precedes the run directory's path on stderr with ``--keep --json`` (its logs under
``logs/``: the servers', the controller's and each agent's)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: stop and clean up.

    A KeyboardInterrupt, not merely a BaseException: the handler raises it wherever the main
    thread is, often inside an event-loop callback or a background task, and asyncio
    re-raises only KeyboardInterrupt and SystemExit from those. Any other exception there is
    logged ("Exception in callback") or kept on the task, and the demo ran on until its
    timeout (seen once in CI: SIGINT, no exit within 60 s)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


DEMO_CALIBRATION = OnlineCalibrationSettings(enabled=False)
"""No online calibration in the demo: every layout is planned and priced from the prior its
kinds' quotas give (``demo.kinds``), so the layouts, and the test that checks them, do not
depend on a fit. Why not fit: a node under a CPU quota that waits (a stage with one layer, a
replica with a small share) computes in bursts at full speed, so its fitted compute scale
is that of the layout it ran, not its throughput; priced with it, the next layout loaded the
0.2-core node with four layers and measured 9x its prediction (docs/demo.md). The
closed-loop tests exercise calibration on such nodes."""


def _raise(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextmanager
def _signals_raise() -> Iterator[None]:
    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s in old:
            signal.signal(s, signal.SIG_IGN)


def _cleanup(reg: ProcessRegistry, cluster: DemoCluster | None) -> list[int]:
    try:
        if cluster is not None:
            cluster.stop()
        reg.stop(["nats", "etcd"], grace_s=5.0)
    finally:
        left = reg.kill_all()
    return left


def _scenario(scn: Scenario, live: Live | None) -> None:
    async def main() -> None:
        await scn.run()

    if live is None:
        asyncio.run(main())
        return
    with live:
        asyncio.run(main())


UNTHROTTLED_PACE_S = 0.05
"""Pace of a worker step where CPU quotas are unavailable: unthrottled, unpaced workers
would take the two cores from the control plane (the demo before node kinds ran so)."""


def quota_support() -> dict[str, Any]:
    """Whether the agents' CPU quotas can be enforced here, and where or why not."""
    from sailor.agent.cpu_quota import detect

    where = detect()
    if isinstance(where, str):
        return {"available": False, "why": where}
    return {"available": True, "where": where.describe()}


def demo_pace(quota: dict[str, Any]) -> float:
    """A worker step's pace: none under quotas (they must bind), else
    :data:`UNTHROTTLED_PACE_S`."""
    return 0.0 if quota["available"] else UNTHROTTLED_PACE_S


def _say_kinds(con: Console, kinds: dict[str, tuple[str, float]], quota: dict[str, Any]) -> None:
    by_kind: dict[tuple[str, float], list[str]] = {}
    for node, kq in kinds.items():
        by_kind.setdefault(kq, []).append(node)
    text = "; ".join(f"{k} at {c:g} cores: {', '.join(ns)}" for (k, c), ns in by_kind.items())
    if quota["available"]:
        con.print(f"  node kinds (CPU quotas, {quota['where']}): {text}")
        return
    msg = (
        f"sailor demo: CPU quotas unavailable here ({quota['why']}): every node runs "
        f"UNTHROTTLED and paced; the kinds ({text}) are still planned from their prior, "
        "but the measured steps will not show the slow kind"
    )
    con.print(f"  [bold yellow]{msg}[/]")
    if con.quiet:  # --json: stdout is the summary; the warning still reaches the user
        print(msg, file=sys.stderr)


def run_demo(
    settings: DemoSettings,
    out: Path,
    con: Console,
    keep: bool,
    show_live: bool,
    auto_pace: bool = True,
) -> dict[str, Any]:
    """Run the cluster demo; return the summary. Raises Interrupted after cleaning up.

    ``auto_pace``: unpaced workers under their quotas, or paced at
    :data:`UNTHROTTLED_PACE_S` where quotas are unavailable (else ``settings.min_step_s``)."""
    from sailor.controller.audit import check, read_records

    quota = quota_support()
    if auto_pace:
        settings = dataclasses.replace(settings, min_step_s=demo_pace(quota))

    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sailor-demo-"))
    if keep and con.quiet:  # --json: the console is silent; the kept directory is named
        print(f"{KEPT_RUN_DIR}{tmp}", file=sys.stderr, flush=True)
    reg = ProcessRegistry(log_dir=tmp / "logs")
    cluster: DemoCluster | None = None
    t_start = time.time()
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    # Resolving the model (a transformers import) and tokenizing the corpus take seconds:
    # overlap them with the servers' start.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="demo-model")
    training = pool.submit(prepare_demo, tmp, settings.global_batch_size)
    pool.shutdown(wait=False)
    try:
        with _signals_raise():
            nodes = node_names(settings.initial_nodes)
            kinds = demo_kinds(nodes)
            _say_kinds(con, kinds, quota)
            job = run_job()
            servers = start_servers(reg, tmp, job, CONTROLLER, nodes)
            con.print(
                f"  nats-server {servers.nats_url}, etcd {servers.etcd_endpoint} (TLS, logins, "
                f"permissions, RBAC); run dir {tmp}"
            )
            cluster = DemoCluster(
                reg=reg,
                servers=servers,
                root=tmp,
                global_batch_size=settings.global_batch_size,
                min_step_s=settings.min_step_s,
                training_file=training.result(timeout=120).training_file,
                model=str(training.result().spec_file),
                online_calibration=DEMO_CALIBRATION,
                kinds=dict(kinds),
                calibration_file=write_prior(tmp / "prior-calibration.json", kinds),
                quota_from="ready",
                in_place=settings.in_place,
                job=job,
            )
            con.print(
                f"  training: GPT-2 (transformers config) on {CORPUS!r}, "
                f"prepared as `{training.result().prepare_command}`"
            )
            live = Live(console=con, refresh_per_second=4, transient=False) if show_live else None
            show: Callable[[RenderableType], None] | None = live.update if live else None
            say = None if show_live else (lambda line: con.print(f"  {line}"))
            scn = Scenario(cluster=cluster, settings=settings, show=show, say=say, t0=t_start)
            _scenario(scn, live)
        records = read_records([cluster.audit_log])
        scn.steps.poll()
    except BaseException:
        _cleanup(reg, cluster)
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    leftovers = _cleanup(reg, cluster)
    node_kinds = {
        "nodes": {n: {"kind": k, "cpu_quota": c} for n, (k, c) in kinds.items()},
        "quota": quota,
        "min_step_s": settings.min_step_s,
    }
    audit_ok = check(records).ok
    try:  # the run directory holds the data set the reference reads
        return _report(scn, records, audit_ok, settings, out, con, t_start, leftovers, node_kinds)
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _report(
    scn: Scenario,
    records: list[dict[str, Any]],
    audit_ok: bool,
    settings: DemoSettings,
    out: Path,
    con: Console,
    t_start: float,
    leftovers: list[int],
    node_kinds: dict[str, Any],
) -> dict[str, Any]:
    import torch

    from sailor.cli.demo.model import demo_model
    from sailor.cli.demo.plot import plot_run
    from sailor.megatron_patch.data import build_dataset
    from sailor.megatron_patch.engine import TrainConfig
    from sailor.megatron_patch.reference import train_reference
    from sailor.schemas.training import parse_training_config

    wall = time.time() - t_start
    points = scn.steps.series()
    last = max((p.step for p in points), default=0)
    gbs = settings.global_batch_size
    con.print(f"  uninterrupted reference: {last} steps in one process …")
    spec, arch = demo_model(gbs)
    tfile = scn.cluster.training_file
    if tfile is None:
        raise ValueError("the demo cluster has no training config")
    tc = parse_training_config(tfile.read_text(), str(tfile))
    data = build_dataset(tc.data, spec, tc.seed, base_dir=tfile.parent)
    cfg = TrainConfig.of(tc)
    # one intra-op thread, as the cluster's ranks train (``--threads``, default 1): with two
    # on the shared 2-core host the two runs below took ~10x the CPU (55 steps: 31 against
    # 2.7 CPU-s), their threads waiting on each other, for the same floor
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_reference(spec, gbs, last, cfg, arch=arch, data=data).losses
        # the same run in another reduction order: the floor rounding alone reaches
        other = train_reference(
            spec, gbs, last, cfg, microbatch_size=max(1, gbs // 2), arch=arch, data=data
        )
    finally:
        torch.set_num_threads(threads)
    tol = loss_tolerance(ref, other.losses)
    commits = [int(r["step"]) for r in records if r.get("kind") == "commit"]
    reconfs = reconfigurations(records, scn.injections, points)
    png = plot_run(points, reconfs, gbs, t_start, out / "demo-cluster.png", reference=ref)
    losses = compare_losses(points, ref, commits, tol)
    summ = summary(points, reconfs, losses, wall, str(png), audit_ok, ref, spec.vocab_size)
    summ["layouts"] = layouts(records, points)
    summ["leftover_processes"] = leftovers
    summ["node_kinds"] = node_kinds
    print_summary(con, summ)
    return summ
