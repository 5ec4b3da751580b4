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
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live

from sailor.cli.demo.cluster import CONTROLLER, JOB, DemoCluster, node_names
from sailor.cli.demo.model import CORPUS, prepare_demo
from sailor.cli.demo.processes import ProcessRegistry
from sailor.cli.demo.reconfig import reconfigurations
from sailor.cli.demo.report import (
    compare_losses,
    layouts,
    loss_tolerance,
    print_summary,
    summary,
)
from sailor.cli.demo.scenario import DemoSettings, Scenario
from sailor.cli.demo.servers import start_servers
from sailor.controller.config import OnlineCalibrationSettings

__all__ = ["Interrupted", "run_demo"]


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: stop and clean up (a BaseException, like Ctrl-C)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


DEMO_CALIBRATION = OnlineCalibrationSettings(
    replan=False, min_steps=5, interval_s=1.0, stable_reports=2
)
"""Online calibration in the demo: fit every second from five steps on, and price the next
membership change's plan with the fit (the first layout is planned from the catalog's
nominal ``cpu`` spec; the summary's layout table shows the prediction converge); no
calibration-driven reconfiguration of its own (the demo's four changes stay the ones it
injects)."""


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


def run_demo(
    settings: DemoSettings, out: Path, con: Console, keep: bool, show_live: bool
) -> dict[str, Any]:
    """Run the cluster demo; return the summary. Raises Interrupted after cleaning up."""
    from sailor.controller.audit import check, read_records

    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sailor-demo-"))
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
            servers = start_servers(reg, tmp, JOB, CONTROLLER, nodes)
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
    try:  # the run directory holds the data set the reference reads
        return _report(scn, records, check(records).ok, settings, out, con, t_start, leftovers)
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
) -> dict[str, Any]:
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
    ref = train_reference(spec, gbs, last, cfg, arch=arch, data=data).losses
    # the same run in another reduction order: the floor rounding alone reaches
    other = train_reference(
        spec, gbs, last, cfg, microbatch_size=max(1, gbs // 2), arch=arch, data=data
    )
    tol = loss_tolerance(ref, other.losses)
    commits = [int(r["step"]) for r in records if r.get("kind") == "commit"]
    reconfs = reconfigurations(records, scn.injections, points)
    png = plot_run(points, reconfs, gbs, t_start, out / "demo-cluster.png", reference=ref)
    losses = compare_losses(points, ref, commits, tol)
    summ = summary(points, reconfs, losses, wall, str(png), audit_ok, ref, spec.vocab_size)
    summ["layouts"] = layouts(records, points)
    summ["leftover_processes"] = leftovers
    print_summary(con, summ)
    return summ
