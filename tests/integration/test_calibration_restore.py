"""A new leader reads a kept calibration back with its ranges (``Calibrator.restore``), over a
real etcd.

The online fit carries its constants' ranges, and the ranges it did not measure (memory,
allocator), into each fitted kind's ``spread``, which the uncertainty corners price
(``fit_corners.with_fitted_spread``). A record kept before it did holds a prior-covered
kind's entry without a spread (every corner one point) and an offline-calibrated kind's
entry with its offline spread (which overrides the fitted constants in every corner): read
back, those spreads are rebuilt from the configured calibration as the fit makes them
(``calibration_restored``'s ``spread_rebuilt`` names the kinds); a record with the fit's
spreads is read back as kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sailor.controller.audit import AuditLog, read_records
from sailor.controller.config import ControllerConfig, OnlineCalibrationSettings
from sailor.controller.online_calibration import Calibrator
from sailor.controller.planning import SailorPlanner
from sailor.coordination import EtcdStore, Keys, Leadership, SystemClock, campaign, connect_etcd
from sailor.localservers import LocalServers
from sailor.schemas.calibration import Calibration
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.online_calibration import CalibrationPointer, CalibrationRecord, OnlineFit
from sailor.simulator.fit_corners import with_constant
from sailor.simulator.online_fit import fit_online
from sailor.simulator.synthetic_timings import expected_rank_timings
from sailor.simulator.uncertainty import corners

pytestmark = pytest.mark.usefixtures("no_task_leak")

FAST, SLOW = "A100-40", "V100-16"
NODES = (
    NodeSpec(node_id="n1", gpu_type=FAST, gpus=1, zone="z-a-1", address="h1"),
    NodeSpec(node_id="n2", gpu_type=SLOW, gpus=1, zone="z-a-1", address="h2"),
)


def _config(tmp: Path, name: str) -> ControllerConfig:
    return ControllerConfig(
        job="t",
        identity=name,
        audit_log=tmp / f"audit-{name}.jsonl",
        planner="sailor",
        model="OPT-350",
        global_batch_size=32,
        online_calibration=OnlineCalibrationSettings(replan=False),
    )


def _old_record(fit: OnlineFit, configured: Calibration) -> OnlineFit:
    """``fit`` as a controller kept it before the fit carried its spread: a fitted kind's
    entry kept the spread it had, none for a kind the configured calibration does not
    calibrate (a new entry), the offline one for a kind it does."""
    cal = fit.calibration
    for g in (FAST, SLOW):
        had = configured.for_gpu(g).spread if configured.is_calibrated(g) else None
        cal = cal.with_gpu(cal.for_gpu(g).model_copy(update={"spread": had}))
    return fit.model_copy(update={"calibration": cal})


async def _keep(store: EtcdStore, lead: Leadership, version: int, fit: OnlineFit) -> None:
    keys = Keys(job="t")
    rec = CalibrationRecord(version=version, epoch=lead.epoch, generation=2, time=0.0, fit=fit)
    ptr = CalibrationPointer(version=version, epoch=lead.epoch)
    await store.put_all_guarded(
        [
            (keys.calibration_version(version), rec.model_dump_json().encode()),
            (keys.calibration, ptr.model_dump_json().encode()),
        ],
        keys.leader,
        lead.epoch,
    )


async def test_a_record_kept_before_the_fit_carried_its_spread_is_read_back_with_ranges(
    servers: LocalServers, tmp_path: Path
) -> None:
    """Fails on the old code: the prior-covered kind's restored entry had no spread (every
    corner priced its fitted point, the pessimistic non-tensor memory the prior's median)."""
    planner = SailorPlanner.from_files("OPT-350", 32)
    res = planner.plan(NODES, None)
    cfg = _config(tmp_path, "c1")
    audit = AuditLog(cfg.audit_log)
    first = Calibrator(cfg, planner, audit, SystemClock())
    inp = first.inputs
    assert first.enabled and inp is not None
    configured = inp.calibration
    assert not configured.is_calibrated(FAST) and configured.prior is not None
    slow = configured.for_gpu(SLOW).compute_scale * 1.5
    truth = with_constant(configured, SLOW, compute_scale=slow)
    timings = expected_rank_timings(
        res.plan, inp.model, inp.profiles, inp.network, inp.prices,
        calibration=truth, gpu_specs=inp.gpu_specs,
    )  # fmt: skip
    fit = fit_online(
        res.plan, timings, inp.model, inp.profiles, inp.network, inp.prices,
        calibration=configured, gpu_specs=inp.gpu_specs,
    )  # fmt: skip
    for g in (FAST, SLOW):  # both kinds run and have an entry of the fit's
        assert any(c.fitted for c in fit.constants if c.gpu_type == g), g
    fresh = fit.calibration.for_gpu(FAST).spread
    assert fresh is not None and fresh.source.startswith("online fit")
    old = _old_record(fit, configured)
    assert old.calibration.for_gpu(FAST).spread is None

    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    try:
        lead = await campaign(store, Keys(job="t").leader, "c1", 5, timeout=10)
        await _keep(store, lead, 1, old)
        c2 = Calibrator(_config(tmp_path, "c2"), planner, audit, SystemClock())
        await c2.restore(store, lead)
        assert c2.version == 1
        # rebuilt as the fit makes it today, and handed to the planner so
        assert c2.calibration == fit.calibration
        assert planner.calibration == fit.calibration
        # what no step timing measures keeps the prior's range in the corners
        mem = {n: c.for_gpu(FAST).memory_overhead_bytes for n, c in corners(c2.calibration)}
        prior = {n: c.for_gpu(FAST).memory_overhead_bytes for n, c in corners(configured)}
        assert mem == prior and mem["pessimistic"] > mem["median"]

        # a record with the fit's spreads is read back as kept
        await _keep(store, lead, 2, fit)
        c3 = Calibrator(_config(tmp_path, "c3"), planner, audit, SystemClock())
        await c3.restore(store, lead)
        assert c3.version == 2 and c3.calibration == fit.calibration
    finally:
        await store.close()
        audit.close()
    restored = [r for r in read_records([cfg.audit_log]) if r["kind"] == "calibration_restored"]
    assert [(r["version"], r["spread_rebuilt"]) for r in restored][-2:] == [
        (1, [FAST, SLOW]),
        (2, []),
    ]
