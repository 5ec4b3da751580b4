"""Values a user can get wrong in ``sailor profile``, ``sailor data prepare`` and ``sailor
plan``, each refused before any work with one line naming the option and the value.

Each was found by running the command with it: a ``ZeroDivisionError`` or "math domain
error" reported as "a bug?" (``profile estimate --tp 0``, ``--mbs 0``), estimates written for
a TP degree no run can use (``--tp 3``), an ``OverflowError`` (``--memory-limit inf``), a
NaN accepted as a time (``--min-time nan``), a probe run to its end and then a curve fit that
cannot be made (``profile network --max-bytes`` equal to ``--min-bytes``), a rank started
with a ``--master`` that is not HOST:PORT (its torch traceback in the error line), an
output folder that cannot be written blamed on the inputs (``data prepare --out``), and a
missing ModelSpec file reported as an unknown catalog name (``plan --model m.json``); and an
output that cannot be written found only after the search, measurement or simulation.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sailor.cli.main import app
from sailor.profiler import collective_probe, network_probe
from tests.measured_profiles import write_measured_db

runner = CliRunner()


def _refused(res: Any, want: str) -> None:
    """Exit 2 (bad input), one ``error:`` line naming ``want``, no "a bug?" line."""
    shown = res.output
    assert res.exit_code == 2, shown
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and want in errors[0], shown
    assert "a bug?" not in shown and "Traceback" not in shown, shown


@pytest.fixture
def measured_db(tmp_path: Path) -> Path:
    """A ProfileDB of OPT-350 (16 heads) with two GPU types at TP 1 and 2, mbs 1."""
    return write_measured_db(tmp_path / "db.json")


@pytest.mark.parametrize(
    "option,value,want",
    [
        ("--tp", "0", "--tp='0'"),  # ZeroDivisionError before
        ("--tp", "-2", "--tp='-2'"),
        ("--tp", "3", "--tp='3'"),  # written for TP 3 before
        ("--tp", "32", "tp=32 must divide OPT-350's num_heads=16"),  # written before
        ("--mbs", "0", "--mbs='0'"),  # "math domain error" before
        ("--mbs", "1,-4", "--mbs='1,-4'"),
    ],
)
def test_profile_estimate_refuses_a_grid_no_run_can_use(
    measured_db: Path, tmp_path: Path, option: str, value: str, want: str
) -> None:
    out = tmp_path / "est.json"
    cmd = ["profile", "estimate", "--gpu", "H100-80", "--from", str(measured_db), "-o", str(out)]
    _refused(runner.invoke(app, [*cmd, option, value]), want)
    assert not out.exists()
    ok = runner.invoke(app, [*cmd, "--tp", "1,2,16", "--mbs", "1,2"])
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize(
    "option,value,want",
    [
        ("--memory-limit", "inf", "--memory-limit='inf'"),  # OverflowError ("a bug?")
        ("--memory-limit", "1e400", "--memory-limit='1e400'"),
        ("--memory-limit", "nan", "--memory-limit='nan'"),  # "cannot convert float NaN"
        ("--memory-limit", "0.5", "--memory-limit='0.5'"),  # "memory_limit=0" before
        ("--min-time", "nan", "min_time_s=nan"),  # measured (and written) before
        ("--threads", "0", "threads=0"),  # torch's own message, after the bar started
    ],
)
def test_profile_layers_refuses_values_before_measuring(
    tmp_path: Path, option: str, value: str, want: str
) -> None:
    out = tmp_path / "db.json"
    cmd = ["profile", "layers", "--model", "tiny-gpt", "--mbs", "1", "-o", str(out)]
    _refused(runner.invoke(app, [*cmd, option, value]), want)
    assert not out.exists()


class _NoProbe:
    """Counts the launches of either probe's ranks: a refused option must start none."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.launches = 0
        monkeypatch.setattr(network_probe, "run_ranks", self._launch)
        monkeypatch.setattr(collective_probe, "run_ranks", self._launch)

    def _launch(self, *args: Any, **kwargs: Any) -> list[Any]:
        self.launches += 1
        raise RuntimeError("a probe's ranks were started")


@pytest.mark.parametrize(
    "args,want",
    [
        # one message size: probed, then "need at least 3 distinct message sizes" (a bug?)
        (["--max-bytes", "65536"], "--max-bytes=65536"),
        (["--min-bytes", "1048576", "--max-bytes", "2097152"], "--max-bytes=2097152"),
        (["--max-bytes", str(4 << 30)], "--max-bytes"),  # the help's 1 GiB; probed before
        (["--rank", "0", "--master", "nohost"], "--master='nohost'"),  # torch traceback
        (["--rank", "1", "--master", "h:65535"], "--master='h:65535'"),  # PORT+1 is 65536
        (["--rank", "0", "--master", ":29500"], "--master=':29500'"),
        (["--master", "h:29500"], "--master='h:29500' without --rank"),  # ignored before
        (["--gpus-per-node", "0"], "--gpus-per-node"),  # pydantic's raw text before
        (["--dst-gpus-per-node", "0"], "--dst-gpus-per-node"),  # probed, then "a bug?"
        # CPU probes recorded under a GPU type (the simulator reads them as its links)
        (["--gpu-type", "A100-40"], "--gpu-type='A100-40' on --device cpu"),
        (["--gpu-type", "Z100", "--new-gpu-type"], "--gpu-type='Z100' on --device cpu"),
        (["--dst-gpu-type", "H100-80"], "--dst-gpu-type='H100-80' on --device cpu"),
    ],
)
def test_profile_network_refuses_options_before_any_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], want: str
) -> None:
    probes = _NoProbe(monkeypatch)
    out = tmp_path / "net.json"
    res = runner.invoke(app, ["profile", "network", "-o", str(out), "--collectives", "", *args])
    _refused(res, want)
    assert probes.launches == 0 and not out.exists()


def test_data_prepare_names_the_bad_input_or_output(tmp_path: Path) -> None:
    doc = tmp_path / "a.txt"
    doc.write_text("one document\n")
    other = tmp_path / "b.txt"
    other.write_text("another document\n")
    base = ["data", "prepare", "--quiet"]
    folder = tmp_path / "texts"
    folder.mkdir()
    res = runner.invoke(app, [*base, str(folder), "--out", str(tmp_path / "o" / "ds")])
    _refused(res, f"{folder}: is a directory")  # "no such file" before
    res = runner.invoke(
        app, [*base, str(doc), str(other), "--max-bytes", "0", "--out", str(tmp_path / "ds")]
    )
    _refused(res, "--max-bytes=0")  # "validation_fraction ... leaves none" before
    # an output folder that cannot be made: named before anything is read
    res = runner.invoke(app, [*base, str(doc), str(other), "--out", str(doc / "ds")])
    _refused(res, f"--out {doc / 'ds'}: cannot create its folder")
    if sys.platform == "linux":  # /proc takes no new file: the write itself fails
        out = Path("/proc/sailor-test-no-such-prefix")
        res = runner.invoke(app, [*base, str(doc), str(other), "--out", str(out)])
        assert res.exit_code == 1, res.output
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        # the inputs were named as the culprit before ("a.txt, b.txt: [Errno 2] ...")
        assert errors == [
            f"error: --out {out}: cannot write {out}.bin.tmp (No such file or directory)"
        ], res.output


def test_plan_names_a_missing_model_file(tmp_path: Path) -> None:
    """A ModelSpec file that is not there was "not in the catalog"."""
    pool = tmp_path / "pool.yaml"
    pool.write_text(
        "entries:\n  - {gpu_type: A100-40, zone: us-central1-a, nodes: 2, gpus_per_node: 4}\n"
    )
    model = tmp_path / "my-model.json"
    res = runner.invoke(app, ["plan", "--model", str(model), "--pool", str(pool)])
    _refused(res, f"{model}: cannot read (No such file or directory)")
    assert "not in the catalog" not in res.output


@pytest.mark.skipif(sys.platform != "linux", reason="/proc takes no new file on Linux only")
@pytest.mark.parametrize(
    "argv,want",
    [
        (["plan", "--model", "OPT-350", "--pool", "{pool}", "-o", "/proc/p.json"], "-o"),
        (["plan", "--model", "OPT-350", "--pool", "{pool}", "--export-sailor", "{tmp}"], "--e"),
        (["profile", "layers", "--mbs", "1", "-o", "/proc/db.json"], "-o"),
        (["profile", "network", "--collectives", "", "-o", "/proc/net.json"], "-o"),
        (["simulate", "{plan}", "--timeline", "/proc/t.png"], "--timeline"),
    ],
    ids=["plan-o", "plan-export", "layers-o", "network-o", "simulate-timeline"],
)
def test_an_output_that_cannot_be_written_is_refused_before_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], want: str
) -> None:
    """Each searched, measured or simulated first and failed at the write (the search's
    table, or a measured unit, printed, then "cannot write"); /proc takes no new file."""
    from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

    pool = tmp_path / "pool.yaml"
    pool.write_text(
        "entries:\n  - {gpu_type: A100-40, zone: us-central1-a, nodes: 1, gpus_per_node: 4}\n"
    )
    rg = ReplicaGroup(gpu_type="A100-40", zone="us-central1-a", tp=1, gpus_per_node=4)
    pipe = Pipeline(
        stages=(Stage(first_layer=0, last_layer=25, replica=rg),),
        microbatch_size=1,
        num_microbatches=8,
    )
    plan = tmp_path / "plan.json"
    plan.write_text(Plan(model="OPT-350", global_batch_size=8, pipelines=(pipe,)).model_dump_json())
    probes = _NoProbe(monkeypatch)
    args = [
        a.replace("{pool}", str(pool)).replace("{tmp}", str(tmp_path)).replace("{plan}", str(plan))
        for a in argv
    ]
    res = runner.invoke(app, args)
    _refused(res, want)
    assert res.stdout == "" and probes.launches == 0, res.output
    assert not list(tmp_path.glob(".*.probe"))


@pytest.mark.parametrize(
    "field,value,want",
    [
        ("phase_timeout_s", -1.0, "phase_timeout_s=-1.0"),  # started the cluster, then timed out
        ("phase_timeout_s", math.inf, "phase_timeout_s=inf"),
        ("notice_s", math.nan, "notice_s=nan"),  # ran the whole demo
        ("min_step_s", -1.0, "min_step_s=-1.0"),  # ran the whole demo
        ("poll_s", 0.0, "poll_s=0.0"),
    ],
)
def test_demo_settings_out_of_reach_are_refused(field: str, value: float, want: str) -> None:
    """``sailor demo`` turns these into its one-line "Invalid value" before any process
    starts (as ``--nodes 2`` already was)."""
    from sailor.cli.demo.scenario import DemoSettings

    with pytest.raises(ValueError, match=re.escape(want)):
        DemoSettings(**{field: value})  # type: ignore[arg-type]


def test_demo_out_that_is_a_file_is_named(tmp_path: Path) -> None:
    """``--out`` naming a file ended "a.txt: File exists" (exit 1)."""
    taken = tmp_path / "a.txt"
    taken.write_text("x")
    res = runner.invoke(app, ["demo", "--plan-only", "--out", str(taken)])
    _refused(res, f"--out {taken}: is a file, not a folder")


@pytest.mark.parametrize(
    "option,value", [("--timeout", "-1"), ("--timeout", "nan"), ("--probe-deadline", "0")]
)
def test_check_refuses_seconds_out_of_reach(option: str, value: str) -> None:
    """With a config, ``--timeout -1`` reached the NATS and etcd clients, whose refusal was
    reported as the servers not answering ("nats ... did not answer: ValueError"); without
    one it was accepted."""
    res = runner.invoke(app, ["check", "--allow-cpu", "--no-probe", option, value])
    _refused(res, f"{option}=")


def test_ckpt_verify_of_a_step_never_committed_is_not_called_corrupt(tmp_path: Path) -> None:
    """``sailor ckpt verify ROOT --step 5`` printed "step 5: CORRUPT" for a step that was
    never saved: an operator reads that as damaged data. Still exit 1 (nothing verified)."""
    res = runner.invoke(app, ["ckpt", "verify", str(tmp_path), "--step", "5"])
    assert res.exit_code == 1, res.output
    assert "CORRUPT" not in res.output, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "step 5 is not committed" in errors[0], res.output


def test_certs_name_the_command_that_makes_a_missing_file(tmp_path: Path) -> None:
    """``certs etcd-flags`` printed flags naming an etcd certificate and key not issued yet
    (etcd then fails at start), and ``certs etcd-rbac`` without root's certificate said
    "create the CA with `sailor certs init`" where the CA was there."""
    pki = tmp_path / "pki"
    assert runner.invoke(app, ["certs", "init", str(pki)]).exit_code == 0
    res = runner.invoke(app, ["certs", "etcd-flags", str(pki)])
    _refused(res, "etcd.crt: no such file: issue it with `sailor certs issue")
    assert "--kind server" in res.stderr and res.stdout == ""
    res = runner.invoke(app, ["certs", "etcd-rbac", str(pki)])
    _refused(res, "root.crt: no such file: issue it with `sailor certs issue")
    assert "--name root --kind client" in res.stderr and "certs init" not in res.stderr
    issued = runner.invoke(app, ["certs", "issue", str(pki), "--name", "etcd", "--kind", "server"])
    assert issued.exit_code == 0, issued.output
    res = runner.invoke(app, ["certs", "etcd-flags", str(pki)])
    assert res.exit_code == 0 and f"--cert-file={pki.resolve()}/etcd.crt" in res.stdout


def _network_side(argv: list[str], tmp_path: Path) -> tuple[int, str, float]:
    """Run one side of ``sailor profile network`` as its own process (its ranks with it);
    (exit status, stderr, seconds). Killed with its ranks after 90 s: the old code waited
    for an unreachable master until the probe's 600 s deadline."""
    import os
    import signal
    import subprocess
    import time

    out = str(tmp_path / "net.json")
    cmd = [sys.executable, "-m", "sailor.cli.main", "profile", "network", "-o", out, *argv]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, "--collectives", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # this side and the ranks it started
            proc.communicate()
    return proc.returncode, err, time.monotonic() - t0


@pytest.mark.parametrize("rank", ["0", "1"], ids=["rank0", "rank1"])
def test_profile_network_refuses_a_master_that_does_not_resolve(tmp_path: Path, rank: str) -> None:
    """``--rank R --master nosuchhost.invalid:PORT`` said nothing and waited for the ranks'
    rendezvous until the probe's deadline (600 s): now refused at once, naming the host."""
    code, err, _ = _network_side(["--rank", rank, "--master", "nosuchhost.invalid:29511"], tmp_path)
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert (
        "--master: master='nosuchhost.invalid:29511': host 'nosuchhost.invalid' does not"
        in (errors[0])
    )
    assert "Traceback" not in err


def test_profile_network_rank1_gives_up_on_a_silent_master_after_connect_timeout(
    tmp_path: Path,
) -> None:
    """Rank 1 with nothing listening at --master waited without a word until the probe's
    deadline; it now says what it waits for and how long, and fails after
    --connect-timeout naming the address."""
    from sailor.localnet import free_port

    master = f"127.0.0.1:{free_port()}"
    argv = ["--rank", "1", "--master", master, "--connect-timeout", "2"]
    code, err, took = _network_side(argv, tmp_path)
    assert code == 1, err
    assert f"waiting up to 2 s for rank 0 at {master} (--connect-timeout)" in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert f"master={master!r}: nothing accepted a connection there within 2 s" in errors[0]
    assert took < 60, took


def test_profile_network_rank0_gives_up_on_a_peer_that_never_joins(tmp_path: Path) -> None:
    """Rank 0 with no rank 1 anywhere waited for it without a limit of its own (its ranks'
    rendezvous gave up after 300 s): it now says how long it waits and fails after
    --connect-timeout, once it listens, naming the option, its value and the address."""
    import time

    from sailor.localnet import free_port

    master = f"127.0.0.1:{free_port()}"
    out = tmp_path / "net.json"
    argv = ["profile", "network", "-o", str(out), "--collectives", ""]
    t0 = time.monotonic()
    res = runner.invoke(app, [*argv, "--rank", "0", "--master", master, "--connect-timeout", "1"])
    took = time.monotonic() - t0
    assert res.exit_code == 1, res.output
    assert f"waiting up to 1 s for rank 1 to join at {master}" in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    assert f"--connect-timeout=1: rank 1 did not join rank 0 at {master} within 1 s" in errors[0]
    assert not out.exists()
    assert took < 45, took  # a rank's start (imports) and 1 s


_BAD_KINDS = {
    "unknown-on-cpu": (["--kind", "Z100"], "--kind='Z100' on --device cpu"),
    "gpu-on-cpu": (["--kind", "A100-40"], "--kind='A100-40' on --device cpu"),
    "new-on-cpu": (["--kind", "Z100", "--new-gpu-type"], "--kind='Z100' on --device cpu"),
    "unknown-on-cuda": (
        ["--kind", "Z100", "--device", "cuda"],
        "--kind='Z100': not a GPU type of the catalog (A100-40, ",
    ),
}


@pytest.mark.parametrize("args,want", list(_BAD_KINDS.values()), ids=list(_BAD_KINDS))
def test_profile_layers_refuses_a_kind_the_planner_would_misread(
    tmp_path: Path, args: list[str], want: str
) -> None:
    """``sailor profile layers --kind Z100`` on CPU measured and recorded CPU timings under a
    GPU name the catalog does not know (and under a known GPU type, as that GPU's speed).
    A CPU's profile is named cpu or cpu-<kind>; a GPU type the catalog lacks needs
    --new-gpu-type. Refused before any measurement, naming the value."""
    out = tmp_path / "db.json"
    res = runner.invoke(app, ["profile", "layers", "--model", "tiny-gpt", *args, "-o", str(out)])
    _refused(res, want)
    assert not out.exists()


def test_profile_layers_new_gpu_type_lets_an_unknown_kind_through_to_the_device() -> None:
    """With --new-gpu-type an unknown GPU name passes the kind check (on this CPU-only host
    the next check, the CUDA device's, refuses it instead)."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA host would run the measurement")
    argv = ["profile", "layers", "--model", "tiny-gpt", "--device", "cuda", "--kind", "Z100"]
    res = runner.invoke(app, [*argv, "--new-gpu-type", "-o", "db.json"])
    _refused(res, "--device=cuda: no CUDA device here")


_BAD_HOSTS = {
    "space": "bad host",
    "port": "nats.example.com:4222",
    "url": "https://nats.example.com",
    "hyphen-first": "-nats.example.com",
    "empty-label": "nats..example.com",
    "empty": "",
}


@pytest.mark.parametrize("host", list(_BAD_HOSTS.values()), ids=list(_BAD_HOSTS))
def test_certs_issue_refuses_a_host_that_is_no_address_or_name(tmp_path: Path, host: str) -> None:
    """``sailor certs issue --host "bad host"`` wrote it into the certificate as a DNS SAN:
    no client can dial that name, and the mistake showed only as a TLS failure elsewhere.
    Refused before anything is written, naming the value."""
    pki = tmp_path / "pki"
    assert runner.invoke(app, ["certs", "init", str(pki)]).exit_code == 0
    res = runner.invoke(
        app, ["certs", "issue", str(pki), "--name", "nats", "--kind", "server", "--host", host]
    )
    _refused(res, f"--host: host={host!r}: not an IP address or a DNS name")
    assert not (pki / "nats.crt").exists() and not (pki / "nats.key").exists()


def test_certs_issue_keeps_addresses_names_and_wildcards(tmp_path: Path) -> None:
    """The check refuses only what is no host: IPv4, IPv6, names with '-' and '_' and a
    leading wildcard label still become the certificate's SANs."""
    from cryptography import x509

    pki = tmp_path / "pki"
    assert runner.invoke(app, ["certs", "init", str(pki)]).exit_code == 0
    hosts = ["10.0.0.5", "fd00::7", "nats-1.us-central1-a.internal", "etcd_0", "*.example.com"]
    argv = ["certs", "issue", str(pki), "--name", "nats", "--kind", "server"]
    res = runner.invoke(app, [*argv, *(a for h in hosts for a in ("--host", h))])
    assert res.exit_code == 0, res.output
    cert = x509.load_pem_x509_certificate((pki / "nats.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    named = [str(v) for v in san.get_values_for_type(x509.IPAddress)]
    named += san.get_values_for_type(x509.DNSName)
    assert set(hosts) <= set(named), named


def test_ctrl_c_in_profile_layers_says_what_is_kept(tmp_path: Path) -> None:
    """^C during ``sailor profile layers`` ended with no word (exit 130): the units saved so
    far are kept in -o (each is merged in as it finishes), and the user is now told so."""
    import signal
    import subprocess
    import time

    from sailor.schemas import ProfileDB

    out = tmp_path / "db.json"
    mbs = ",".join(str(2**i) for i in range(10))  # ten units: far from done at the first save
    argv = ["profile", "layers", "--model", "tiny-gpt", "--mbs", mbs, "--no-memory"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sailor.cli.main", *argv, "--no-overhead", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # the child's ^C is Python's KeyboardInterrupt even where this runner ignores SIGINT
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), "no unit was saved"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, err
    assert re.search(r"interrupted: the \d+ \(TP, mbs\) unit\(s\) finished before it", err), err
    assert "Traceback" not in err, err
    kept = ProfileDB.model_validate_json(out.read_text())
    assert kept.model == "tiny-gpt" and kept.timings


def test_plan_off_a_terminal_leaves_no_empty_line_on_stderr(tmp_path: Path) -> None:
    """The search's transient progress bar, off a terminal (a log, CI), left an empty line
    on stderr before the error line, or alone after a clean plan."""
    pool = tmp_path / "pool.yaml"
    pool.write_text(
        "entries:\n  - {gpu_type: A100-40, zone: us-central1-a, nodes: 2, gpus_per_node: 4}\n"
    )
    base = ["plan", "--model", "OPT-350", "--pool", str(pool), "--risk", "median"]
    res = runner.invoke(app, base)
    assert res.exit_code == 0 and res.stderr == "", repr(res.stderr)
    res = runner.invoke(app, [*base, "--min-throughput", "1000"])
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("error: no feasible plan"), repr(res.stderr)
