"""``sailor profile network``: measure a link and all-reduces with the training backend.

The command (point-to-point probe on loopback or between two nodes, then the all-reduce
probe), the checks of its options and endpoint before any probe runs, the all-reduce
records it merges into the NetworkProfile, and the printed fit. Registered on
``profile_group.profile_app``; ``profile_cmd`` imports this module so the command exists.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from sailor.cli._io import check_out, fail, load_model, write_json
from sailor.cli.profile_group import check_kind, fmt_ms, local_gpu_type, parse_ints, profile_app
from sailor.cli.tables import print_table
from sailor.profiler.procs import PeerNotJoinedError
from sailor.schemas import BandwidthCurve, Endpoint, NetworkProfile
from sailor.schemas.network import CollectiveLatency

if TYPE_CHECKING:
    from sailor.profiler.network_probe import ProbePoint

__all__ = ["network_cmd"]


_MAX_MESSAGE = 1 << 30
"""The largest message ``--max-bytes`` takes (1 GiB): each rank holds one in memory."""

_FIT_SIZES = 3
"""Message sizes the fitted curve needs at least (``curve_fit.fit_curve``)."""


def _next_port(master: str) -> str:
    """``host:port+1``: where the collective probe's rank 0 listens after the link probe
    (``master`` checked by :func:`_check_master`)."""
    host, _, port = master.rpartition(":")
    return f"{host}:{int(port) + 1}"


def _check_master(master: str) -> None:
    """``HOST:PORT`` with a port below 65535: the link probe listens on PORT, the
    all-reduce probe on PORT+1. Checked before any probe starts a rank."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise fail(
            f"--master={master!r}: expected HOST:PORT with a port from 1 to 65534 (the "
            "link probe listens on PORT, the all-reduce probe on PORT+1)"
        )


@profile_app.command("network")
def network_cmd(
    out: Path = typer.Option(..., "-o", "--out", help="NetworkProfile JSON to merge into."),
    zone: str = typer.Option(
        "local",
        help="Zone of the sending endpoint: the zone of the pool's nodes, which the simulator "
        "matches (a GPU node's records under 'local' are warned about).",
    ),
    gpu_type: str | None = typer.Option(
        None,
        help="GPU type of the sending endpoint (default: 'cpu', or the catalog type of CUDA "
        "device 0 with --device cuda): on --device cpu, cpu or a CPU kind cpu-<kind>; on "
        "cuda a catalog GPU type (or --new-gpu-type).",
    ),
    new_gpu_type: bool = typer.Option(
        False,
        "--new-gpu-type",
        help="--gpu-type / --dst-gpu-type name a GPU type the catalog does not list yet (with "
        "--device cuda): record the link under it anyway. Without it an unknown type is "
        "refused.",
    ),
    gpus_per_node: int | None = typer.Option(
        None,
        min=1,
        help="GPUs per node of the sending endpoint (default: on cuda the GPUs this process "
        "sees, torch.cuda.device_count(); on cpu 1).",
    ),
    dst_zone: str | None = typer.Option(None, help="Receiving zone (default: --zone)."),
    dst_gpu_type: str | None = typer.Option(None, help="Receiving GPU type (default: same)."),
    dst_gpus_per_node: int | None = typer.Option(
        None, min=1, help="Receiving VM shape (default: same)."
    ),
    intra: bool = typer.Option(
        False,
        help="Record as the intra-node curve of the endpoint. Implied with --device cuda on "
        "loopback (two GPUs of this node); refused with --rank (two nodes).",
    ),
    min_bytes: int = typer.Option(64 << 10, help="Smallest message, bytes (64 KiB)."),
    max_bytes: int = typer.Option(
        256 << 20, max=_MAX_MESSAGE, help="Largest message, bytes (up to 1 GiB)."
    ),
    bytes_per_size: int = typer.Option(256 << 20, help="Bytes to move per message size."),
    latency: bool = typer.Option(True, help="Fit a per-message latency before the curve."),
    statistic: str = typer.Option("median", help="Per-size time: median or mean (with stalls)."),
    collectives: str | None = typer.Option(
        None,
        help="Rank counts for the all-reduce probe on this node, comma-separated ('' skips it; "
        "default 2,3,4, on cuda those up to the GPUs this process sees: one rank per GPU). "
        "With --rank: one rank per node, 2 ranks.",
    ),
    collective_sizes: str = typer.Option(
        "auto",
        help="All-reduce sizes (bytes) for the backend's bus bandwidth, fitted by least squares "
        "('auto': 1 KiB..256 MiB on cuda, 64 KiB..4 MiB on cpu; '' skips it).",
    ),
    device: str = typer.Option(
        "cpu", help="cpu (gloo, host memory) or cuda (NCCL, GPU memory: one GPU per rank)."
    ),
    rank: int | None = typer.Option(
        None,
        help="Between two nodes: run only this side (0 or 1) here; the other node runs the "
        "other side with the same --master. Rank 0 writes --out. Default: both on loopback.",
    ),
    master: str | None = typer.Option(
        None,
        help="HOST:PORT where rank 0 listens (with --rank): the link probe on PORT, the "
        "all-reduce probe on PORT+1 (both must be free there).",
    ),
    gpu: int = typer.Option(0, help="With --rank and cuda: the (first) GPU of this node to use."),
    connect_timeout: float = typer.Option(
        120.0,
        min=0.0,
        help="With --rank: seconds each side waits for the other before failing with the "
        "address: rank 1 for rank 0 to accept a connection at --master (it may start after "
        "this side), rank 0, once it listens, for rank 1's ranks to join (each probe; their "
        "start counts); a --master host that does not resolve is refused at once on either "
        "side.",
    ),
    pairs: int = typer.Option(
        1,
        help="Pairs of ranks that exchange slices of each message at once (one per GPU or "
        "NIC of a node; each side runs this many, on GPUs --gpu.. with cuda): the node "
        "pair's bandwidth, which the simulator reads a link as. 1: one stream, which on a "
        "node with a NIC per GPU measures one NIC.",
    ),
) -> None:
    """Point-to-point bandwidth vs message size between two ranks with the training backend
    (gloo on cpu, NCCL on cuda): both on loopback here, or one per node (--rank, --master).
    On cuda on loopback the two ranks are GPUs 0 and 1 of this node: the curve is recorded
    as the node's intra-node curve.

    Then the fixed cost of a tiny all-reduce (what the simulator charges a ring once, instead
    of the p2p latency per ring step) and the all-reduce's bus bandwidth fitted over
    ``--collective-sizes``: on this node among each of ``--collectives`` rank counts
    (recorded as intra-node: rings inside one node), or with --rank between the two nodes,
    one rank each, at the port after --master's (recorded as inter-node: rings across nodes).
    The link is written first, then each all-reduce as it finishes.
    """
    from sailor.profiler.curve_fit import fit_link, fit_residuals, with_link
    from sailor.profiler.network_probe import ProbeSettings, probe_sizes, run_probe

    gpus = _visible_gpus(device)
    gpu_loopback = device == "cuda" and rank is None
    if gpu_loopback and gpus < 2:
        raise fail(
            f"--device cuda on loopback: the two ranks need a GPU each, but this process sees "
            f"{gpus} GPU(s): probe between two nodes with --rank 0|1 --master HOST:PORT"
        )
    if pairs < 1:
        raise fail(f"--pairs={pairs}: need at least one pair")
    if pairs > 1 and intra:
        raise fail(
            f"--pairs={pairs} with --intra: an intra-node curve is one GPU's link to a peer; "
            "pairs measure the link between two nodes"
        )
    if gpu_loopback and pairs > 1:
        raise fail(
            f"--pairs={pairs} on cuda on loopback: the intra-node curve is one GPU's link to a "
            "peer; pairs measure the link between two nodes (--rank 0|1 --master HOST:PORT)"
        )
    if rank is not None and intra:
        raise fail(
            f"--intra with --rank {rank}: the two ranks are on two nodes, an inter-node link "
            "(--intra is for a link between GPUs of one node: run on loopback)"
        )
    ranks, sizes = _collective_plan(collectives, collective_sizes, rank, master, device, gpus)
    if master is not None:
        from sailor.profiler.procs import resolve_master

        try:
            resolve_master(master)
        except ValueError as exc:
            raise fail(f"--master: {exc}") from None
    if rank != 1:  # rank 0 (or both on loopback) writes --out: check it before probing
        check_out(out, "-o", "the NetworkProfile file to merge into")
        if out.exists():
            load_model(out, NetworkProfile)
    misread = (
        "a link and all-reduces measured on the CPU (gloo, host memory) recorded under a GPU "
        "type would be read as that GPU node's"
    )
    for option, kind in (("--gpu-type", gpu_type), ("--dst-gpu-type", dst_gpu_type)):
        if kind is not None:
            check_kind(option, kind, device, new_gpu_type, misread)
    if gpu_type is None:
        gpu_type = local_gpu_type(device)
    if gpus_per_node is None:
        gpus_per_node = gpus if device == "cuda" and gpus > 0 else 1
    try:
        settings = ProbeSettings(
            min_bytes=min_bytes,
            max_bytes=max_bytes,
            bytes_per_size=bytes_per_size,
            device=device,
            pairs=pairs,
        )
        src = Endpoint(zone=zone, gpu_type=gpu_type, gpus_per_node=gpus_per_node)
        dst = Endpoint(
            zone=dst_zone or zone,
            gpu_type=dst_gpu_type or gpu_type,
            gpus_per_node=dst_gpus_per_node or gpus_per_node,
        )
    except ValueError as exc:
        raise fail(str(exc)) from exc
    sizes_probed = len(probe_sizes(settings))
    if sizes_probed < _FIT_SIZES:
        raise fail(
            f"--min-bytes={min_bytes}, --max-bytes={max_bytes}: {sizes_probed} message "
            f"size(s), the fitted curve needs at least {_FIT_SIZES} (sizes double from "
            "--min-bytes): give a --max-bytes at least 4 times --min-bytes"
        )
    if statistic not in ("median", "mean"):
        raise fail(f"--statistic={statistic!r}: use median or mean")
    if gpu_loopback:
        if dst != src:
            raise fail(
                "--dst-zone/--dst-gpu-type/--dst-gpus-per-node: on cuda on loopback both ranks "
                "are GPUs of this node, one endpoint, recorded as its intra-node curve; probe "
                "between two nodes with --rank 0|1 --master HOST:PORT"
            )
        intra = True
    elif intra and dst != src:
        raise fail(f"--intra: an intra-node curve has one endpoint, got {src} and {dst}")
    for warning in _endpoint_warnings(src, device, gpus, bool(ranks)):
        _warn(warning)
    con = Console()
    backend = "gloo" if device == "cpu" else "NCCL"
    where = "on loopback" if rank is None else f"side {rank} of 2, rank 0 at {master}"
    if rank == 1 and master is not None:
        _wait_for_rank0(con, master, connect_timeout)
    elif rank == 0:
        typer.echo(
            f"waiting up to {connect_timeout:g} s for rank 1 to join at {master} once this side "
            "listens (--connect-timeout)",
            err=True,
        )
    # rank 0 waits for its peer --connect-timeout at most; rank 1's ranks start only once
    # rank 0 listens (_wait_for_rank0), and fail as soon as rank 0's ranks give up
    join_timeout = connect_timeout if rank == 0 else None
    try:
        with con.status(f"probing {2 * pairs} {backend} ranks ({where})..."):
            points = run_probe(
                settings, rank=rank, master=master, gpu=gpu, join_timeout_s=join_timeout
            )
    except PeerNotJoinedError as exc:
        raise fail(_not_joined(exc), code=1) from None
    except (RuntimeError, ValueError) as exc:
        raise fail(str(exc)) from exc
    probe = _CollectiveProbe(
        src,
        statistic,
        sizes,
        device,
        rank,
        None if master is None else _next_port(master),
        gpu,
        connect_timeout,
    )
    if rank == 1:
        for n in ranks:
            try:
                probe.run(con, n)
            except (RuntimeError, ValueError) as exc:
                raise fail(f"all-reduce among {n} ranks: {exc}") from exc
        con.print(f"rank 1 done: rank 0 at {master} writes the link and the all-reduce")
        return
    measured = [(p.nbytes, p.time.central(statistic)) for p in points]
    curve = fit_link(measured, latency=latency)
    resid = fit_residuals(curve, measured)
    load = os.getloadavg()[0]
    source = (
        f"sailor profile network: torch.distributed {backend} send/recv ping-pong "
        f"({device}), "
        + ("2 processes " if pairs == 1 else f"{pairs} pairs of processes at once, ")
        + (
            ("on loopback" + (" (GPUs 0 and 1 of one node)" if gpu_loopback else ""))
            if rank is None
            else f"on two nodes (rank 0 at {master})"
        )
        + f", {len(points)} sizes {min_bytes}..{max_bytes} B, load average {load:.2f}"
    )
    old = load_model(out, NetworkProfile) if out.exists() else None
    net = with_link(old, src, dst, curve, intra=intra, source=source)
    write_json(net, out)  # the link is kept whatever the all-reduces do
    lats: list[CollectiveLatency] = []
    failed = ""
    for n in ranks:
        try:
            lat = probe.run(con, n)
        except (RuntimeError, ValueError) as exc:
            failed = f"all-reduce among {n} ranks: {exc}"
            break
        lats.append(lat)
        net = _with_collectives(net, src, (n,), [lat])
        write_json(net, out)
    _print_link(con, src, dst, points, statistic, curve, resid, load, intra)
    for c in lats:
        bus = f", bus bandwidth {c.bus_gbps:.2f} GB/s" if c.bus_gbps else ""
        con.print(
            f"all-reduce among {c.ranks} ranks ({c.scope.replace('_', '-')}): latency "
            f"{c.latency_s * 1e3:.3f} ms{bus}"
        )
    if failed:
        done = "".join(f", the all-reduce among {c.ranks} ranks" for c in lats)
        raise fail(f"{failed}\n(the link{done} written to {out})")
    con.print(f"written to {out}")


_DEFAULT_COLLECTIVES: tuple[int, ...] = (2, 3, 4)


def _wait_for_rank0(con: Console, master: str, timeout_s: float) -> None:
    """Rank 1: wait up to ``timeout_s`` for rank 0 to listen at ``master``, saying so; an
    unreachable master fails then with its address (the ranks' own rendezvous waited for it
    until the probe's deadline, 600 s, without a word)."""
    from sailor.profiler.procs import MasterUnreachableError, wait_for_master

    typer.echo(
        f"waiting up to {timeout_s:g} s for rank 0 at {master} (--connect-timeout)", err=True
    )
    try:
        with con.status(f"waiting for rank 0 at {master}..."):
            wait_for_master(master, timeout_s)
    except MasterUnreachableError as exc:
        raise fail(str(exc), code=1) from None
    except ValueError as exc:
        raise fail(f"--master: {exc}") from None


def _not_joined(exc: PeerNotJoinedError) -> str:
    """What rank 0 says when rank 1's ranks did not join within --connect-timeout (before,
    it waited for them until its ranks' rendezvous gave up, 300 s)."""
    t = f"{exc.timeout_s:g}"
    return (
        f"--connect-timeout={t}: rank 1 did not join rank 0 at {exc.master} within {t} s of "
        f"this side listening: start `sailor profile network --rank 1 --master {exc.master}` "
        "(the same --pairs and --collectives) on the other node, check that it reaches this "
        "address (the firewall), or wait longer with --connect-timeout"
    )


def _visible_gpus(device: str) -> int:
    """GPUs this process sees on cuda (``torch.cuda.device_count()``: CUDA_VISIBLE_DEVICES
    applies); 0 on cpu."""
    if device != "cuda":
        return 0
    import torch

    return int(torch.cuda.device_count())


def _warn(msg: str) -> None:
    typer.echo(f"warning: {msg}", err=True)


def _endpoint_warnings(src: Endpoint, device: str, gpus: int, collectives: bool) -> list[str]:
    """Why the records of a GPU node are unlikely to be found (pure). The simulator finds an
    all-reduce record by its exact endpoint (``NetworkProfile.collective_latency``) and a
    link by its zones first (``NetworkProfile.inter``): a GPU pool's nodes are in a real zone
    and have their GPU count, not 'local' and 1 (the CPU loopback convention)."""
    if device != "cuda":
        return []
    out: list[str] = []
    what = "the link and the all-reduces" if collectives else "the link"
    if src.zone == "local":
        out.append(
            f"--zone local (the default): {what} are recorded for zone 'local'; the simulator "
            "matches all-reduce records by their exact endpoint (zone, GPU type, GPUs per "
            "node) and inter-node links by their zones, so a pool whose nodes are in another "
            "zone will not use them: pass --zone with the nodes' zone"
        )
    if gpus and src.gpus_per_node != gpus:
        out.append(
            f"--gpus-per-node {src.gpus_per_node}, but this process sees {gpus} GPU(s): "
            f"{what} are recorded for nodes of {src.gpus_per_node} GPUs, and all-reduce "
            "records match only nodes of exactly that many (CUDA_VISIBLE_DEVICES hiding "
            "some of the node's GPUs?)"
        )
    return out


def _collective_plan(
    collectives: str | None,
    collective_sizes: str,
    rank: int | None,
    master: str | None,
    device: str,
    gpus: int = 0,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The all-reduce probe's rank counts and sizes from the options, checked before any
    probe runs. On cuda on loopback (one rank per GPU of this node) the default counts are
    clamped to the ``gpus`` this process sees, with a warning; counts given that exceed them
    are refused."""
    from sailor.profiler.collective_probe import sweep_sizes

    ranks: tuple[int, ...]
    if collectives is None:
        ranks = _DEFAULT_COLLECTIVES
    else:
        ranks = parse_ints(collectives, "collectives") if collectives.strip() else ()
    if rank is not None and (rank not in (0, 1) or not master):
        raise fail(f"--rank={rank}, --master={master!r}: a side is --rank 0 or 1, with --master")
    if master is not None and rank is None:
        raise fail(
            f"--master={master!r} without --rank: both ranks run here on loopback and would "
            "not use it; give --rank 0 or 1 for a probe between two nodes"
        )
    if master is not None:
        _check_master(master)
    if any(n < 2 for n in ranks):
        raise fail(f"--collectives={collectives!r}: an all-reduce needs at least 2 ranks")
    if rank is not None and ranks:
        ranks = (2,)  # one rank per node
    elif device == "cuda" and ranks:
        over = [n for n in ranks if n > gpus]
        if over and collectives is not None:
            raise fail(
                f"--collectives={collectives!r}: one rank per GPU, but this process sees "
                f"{gpus} GPU(s): give rank counts up to {gpus} (CUDA_VISIBLE_DEVICES?)"
            )
        if over:
            ranks = tuple(n for n in ranks if n <= gpus)
            among = ", ".join(map(str, ranks)) if ranks else "no"
            _warn(
                f"--collectives (default {','.join(map(str, _DEFAULT_COLLECTIVES))}): this "
                f"process sees {gpus} GPU(s), one rank per GPU: all-reduces among {among} "
                f"ranks only (not {', '.join(map(str, over))})"
            )
    if collective_sizes.strip() == "auto":
        sizes = sweep_sizes(device)
    else:
        sizes = parse_ints(collective_sizes, "collective-sizes") if collective_sizes.strip() else ()
    if any(b < 8 for b in sizes):
        raise fail(f"--collective-sizes={collective_sizes!r}: sizes are bytes, at least 8")
    return ranks, sizes


@dataclass(frozen=True)
class _CollectiveProbe:
    """The all-reduce probe as ``sailor profile network`` runs it after the link probe."""

    src: Endpoint
    statistic: str
    sizes: tuple[int, ...]
    device: str
    rank: int | None
    master: str | None
    """Where rank 0 listens for it (the port after the link probe's), with --rank."""
    gpu: int
    connect_timeout: float = 120.0
    """With ``rank``: how long rank 1 waits for rank 0 to listen at ``master``, and rank 0,
    once it listens, for rank 1's rank to join."""

    def run(self, con: Console, ranks: int) -> CollectiveLatency:
        """The all-reduce among ``ranks`` ranks (each count is saved before the next runs)."""
        from sailor.profiler.collective_probe import collective_latencies

        between = (
            "on this node" if self.rank is None else f"between 2 nodes (rank 0 at {self.master})"
        )
        if self.rank == 1 and self.master is not None:
            from sailor.profiler.procs import wait_for_master

            wait_for_master(self.master, self.connect_timeout)
        try:
            with con.status(f"timing all-reduces {between}: {ranks} ranks..."):
                (lat,) = collective_latencies(
                    self.src,
                    (ranks,),
                    self.statistic,
                    load=f", load average {os.getloadavg()[0]:.2f}",
                    sizes=self.sizes,
                    device=self.device,
                    rank=self.rank,
                    master=self.master,
                    gpu=self.gpu,
                    join_timeout_s=self.connect_timeout if self.rank == 0 else None,
                )
        except PeerNotJoinedError as exc:
            raise RuntimeError(_not_joined(exc)) from None
        return lat


def _with_collectives(
    net: NetworkProfile, src: Endpoint, ranks: tuple[int, ...], lats: list[CollectiveLatency]
) -> NetworkProfile:
    """``net`` with ``lats`` replacing its all-reduces of ``src`` at those rank counts and
    scope."""
    if not lats:
        return net
    scope = lats[0].scope
    kept = tuple(
        c
        for c in net.collectives
        if not (c.endpoint == src and c.ranks in set(ranks) and c.scope == scope)
    )
    return NetworkProfile.model_validate(
        {**net.model_dump(), "collectives": [c.model_dump() for c in (*kept, *lats)]}
    )


def _print_link(
    con: Console,
    src: Endpoint,
    dst: Endpoint,
    points: Sequence[ProbePoint],
    statistic: str,
    curve: BandwidthCurve,
    resid: Sequence[float],
    load: float,
    intra: bool = False,
) -> None:
    """The probe's points against the fitted curve, then the curve."""
    title = (
        f"intra-node {src.zone}/{src.gpu_type}x{src.gpus_per_node}"
        if intra
        else f"{src.zone}/{src.gpu_type}x{src.gpus_per_node} -> {dst.zone}/"
        f"{dst.gpu_type}x{dst.gpus_per_node}"
    )
    t = Table(title=title)
    for col in ("bytes", "one-way ms", "±", "GB/s", "fit GB/s", "fit time err"):
        t.add_column(col, justify="right")
    for p, r in zip(points, resid, strict=True):
        t.add_row(
            f"{p.nbytes:,}",
            fmt_ms(p.time.central(statistic)),
            fmt_ms(p.time.stdev_s),
            f"{p.nbytes / p.time.central(statistic) / 1e9:.3f}",
            f"{curve.gbps(p.nbytes):.3f}",
            f"{100 * r:+.1f}%",
        )
    print_table(con, t)
    c0, c1, c2 = curve.coeffs
    con.print(
        f"GB/s = {c0:.4g}·L² + {c1:.4g}·L + {c2:.4g} (L = log2(bytes/1e6)), "
        f"max {curve.max_gbps:.3f} GB/s, latency {curve.latency_s * 1e3:.3f} ms; "
        f"mean |time error| {100 * statistics.fmean(abs(r) for r in resid):.1f}%; "
        f"load average {load:.2f}"
    )
