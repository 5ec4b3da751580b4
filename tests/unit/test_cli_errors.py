"""Every CLI command, fed a missing, an empty or a malformed input, fails with one line.

The commands are enumerated from the CLI's parser (a new command is covered without editing this
file). Each file parameter that the command reads gets the bad file; each other required value
gets a name that does not exist. The command must exit non-zero, print no traceback, and print
exactly one ``error:`` line naming the bad file or value.

A command is run only if it has an input to spoil: commands without one (``demo``, ``catalog
gpus``, ``profile network`` ...) would run for real, and are listed by
``test_commands_without_inputs_are_the_known_ones``. Parameters that *write* (``-o``,
``--pareto`` ...: their help says "write" or "output") get a fresh path in a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from sailor import catalog
from sailor.cli.errors import CliError, describe
from sailor.cli.main import app

runner = CliRunner()

BAD_NAME = "no-such-name"


def _leaves(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if hasattr(cmd, "commands"):
        for name, sub in sorted(cmd.commands.items()):
            yield from _leaves(sub, (*path, name))
    else:
        yield path, cmd


def _is_path(param: Any) -> bool:
    return "Path" in str(param.bare_type())


def _writes(param: Any) -> bool:
    text = f"{param.name} {param.help or ''}".lower()
    return param.name in ("out", "output") or "write" in text or "output" in text


def _inputs(cmd: Any) -> list[Any]:
    """The parameters a bad input can go to: files it reads, and required values."""
    return [
        p
        for p in cmd.params
        if not getattr(p, "is_flag", False) and (not _writes(p) if _is_path(p) else p.required)
    ]


COMMANDS = dict(_leaves(typer.main.get_command(app)))
WITH_INPUTS = sorted(" ".join(k) for k, c in COMMANDS.items() if _inputs(c))


def _argv(cmd: Any, bad: Path, out_dir: Path) -> list[str]:
    argv: list[str] = []
    for p in cmd.params:
        if getattr(p, "is_flag", False):
            continue
        if _is_path(p) and _writes(p):
            if not p.required:
                continue
            value = str(out_dir / f"{p.name}.out")
        elif _is_path(p):
            value = str(bad)
        elif p.required:
            value = BAD_NAME
        else:
            continue
        argv += [value] if p.param_type_name == "argument" else [p.opts[0], value]
    return argv


def _bad_file(mode: str, tmp: Path, suffix: str) -> Path:
    path = tmp / f"input-{mode}{suffix}"
    if mode == "empty":
        path.write_text("")
    elif mode == "malformed":
        path.write_text("{ this: is [ not valid\n" if suffix == ".yaml" else "{not json")
    return path  # "missing": never created


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@pytest.mark.parametrize("mode", ["missing", "empty", "malformed"])
@pytest.mark.parametrize("name", WITH_INPUTS)
def test_bad_input_is_one_line_error(
    name: str, mode: str, suffix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a bad name given as a relative path stays in the test's folder
    cmd = COMMANDS[tuple(name.split())]
    bad = _bad_file(mode, tmp_path, suffix)
    argv = [*name.split(), *_argv(cmd, bad, tmp_path / "written")]
    res = runner.invoke(app, argv)
    shown = f"$ sailor {' '.join(argv)}\n{res.output}"
    assert res.exit_code != 0, shown
    assert isinstance(res.exception, SystemExit), shown  # not an exception escaping the CLI
    assert "Traceback" not in res.output, shown
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, shown
    assert bad.name in errors[0] or BAD_NAME in errors[0], shown


def test_commands_without_inputs_are_the_known_ones() -> None:
    """The commands the test above cannot spoil: they read no file and need no value."""
    without = {" ".join(k) for k, c in COMMANDS.items() if not _inputs(c)}
    assert without == {
        "catalog gpus",
        "catalog models",
        "catalog prices",
        "certs init",  # DIRECTORY is written to
        "demo",
        "profile network",  # -o is merged into when it exists, else written
        "worker",
    }


def test_describe_words_each_kind_of_exception() -> None:
    from pydantic import BaseModel, ValidationError

    class Job(BaseModel):
        gpus: int

    try:
        Job.model_validate({"gpus": "many"})
    except ValidationError as exc:
        line, code = describe(exc)
    assert "gpus" in line and "'many'" in line and "\n" not in line and code == 2
    line, _ = describe(FileNotFoundError(2, "No such file or directory", "a.yaml"))
    assert line.startswith("a.yaml: no such file")
    line, code = describe(CliError("x.json: two\nlines", code=1))
    assert line == "x.json: two; lines" and code == 1
    line, code = describe(RuntimeError("boom"))
    assert line.startswith("RuntimeError: boom") and "SAILOR_TRACEBACK" in line and code == 1


def test_unexpected_exception_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sailor.cli.catalog_cmd as catalog_cmd

    def boom() -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(catalog_cmd.catalog, "gpus", boom)
    res = runner.invoke(app, ["catalog", "gpus"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.stderr.strip().splitlines() == [
        "error: RuntimeError: boom; second line (a bug? SAILOR_TRACEBACK=1 shows where)"
    ]


def test_an_unreadable_key_is_named_before_connecting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sailor certs`` writes keys 0600 for the user who ran it (root, usually); the daemons
    run as ``sailor``: the start names the file and what to do, not a TLS failure later."""
    import os

    from sailor.cli.runtime_cmd import _check_security_files
    from sailor.coordination.security import SecurityConfig

    ca, cert, key = tmp_path / "ca.crt", tmp_path / "node.crt", tmp_path / "node.key"
    for f in (ca, cert, key):
        f.write_text("x")
    sec = SecurityConfig(ca_file=ca, cert_file=cert, key_file=key)
    _check_security_files(tmp_path / "agent.yaml", sec)  # readable: passes
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != key and real(p, m))
    with pytest.raises(CliError, match=r"security.key_file='.*node.key': not readable"):
        _check_security_files(tmp_path / "agent.yaml", sec)


def test_out_of_range_options_are_refused_by_name(tmp_path: Path) -> None:
    """Values that used to crash deep inside (``--gbs 0``: a division by zero in the upper
    bound), search for nothing (``--top 0``, a cap on a GPU type the pool lacks) or name
    another option (``--device tpu``) are refused up front, naming the option."""
    import torch

    pool = tmp_path / "pool.yaml"
    pool.write_text(
        "entries:\n  - {gpu_type: A100-40, zone: us-central1-a, nodes: 2, gpus_per_node: 4}\n"
    )
    base = ["plan", "--model", "OPT-350", "--pool", str(pool)]
    for extra, want in (
        (["--gbs", "0"], "--gbs"),
        (["--top", "0"], "--top"),
        (["--max-gpus", "A100-41=4"], "--max-gpus A100-41"),
    ):
        res = runner.invoke(app, [*base, *extra])
        assert res.exit_code != 0 and want in res.output, res.output
        assert "ZeroDivisionError" not in res.output and "Traceback" not in res.output
    prof = ["profile", "layers", "--model", "tiny-gpt", "-o", str(tmp_path / "x.json")]
    res = runner.invoke(app, [*prof, "--device", "tpu"])
    assert res.exit_code != 0 and "--device='tpu'" in res.output, res.output
    if not torch.cuda.is_available():
        res = runner.invoke(app, [*prof, "--device", "cuda"])
        assert res.exit_code != 0 and "no CUDA device here" in res.output, res.output
    # an output that cannot take the result is refused before measuring, not after
    other = tmp_path / "other.json"
    other.write_text('{"model": "OPT-350", "timings": []}')
    for out, want in (
        (other, "holds profiles of model 'OPT-350', not 'tiny-gpt'"),
        (tmp_path, "is a directory"),
    ):
        res = runner.invoke(app, ["profile", "layers", "--model", "tiny-gpt", "-o", str(out)])
        assert res.exit_code == 2 and want in res.output, res.output
    # ... and so is one whose layers of the kind and TP degree were taken in another
    # precision than this run's (the simulator reads one per GPU type and TP degree)
    held = {"gpu_type": "cpu", "tp": 1, "microbatch_size": 4, "layer": 0, "kind": "embedding"}
    times = {"fwd_s": 1e-3, "bwd_s": 2e-3, "update_s": 1e-4, "precision": "bf16"}
    other.write_text(json.dumps({"model": "tiny-gpt", "timings": [{**held, **times}]}))
    res = runner.invoke(app, ["profile", "layers", "--kind", "cpu", "--mbs", "1", "-o", str(other)])
    assert res.exit_code == 2 and "tp=1 mbs=4 in bf16" in res.output, res.output
    assert json.loads(other.read_text())["timings"][0]["precision"] == "bf16"  # untouched
    # ... one whose layer sizes at a TP degree this run does not measure are in another
    # precision (sizes are per model, read for every GPU type; tiny-gpt is fp32: sizes written)
    size = {"tp": 2, "layer": 0, "params": 1, "activation_bytes_per_sample": 8}
    size |= {"output_bytes_per_sample": 8, "precision": "bf16"}
    other.write_text(json.dumps({"model": "tiny-gpt", "sizes": [size]}))
    res = runner.invoke(app, ["profile", "layers", "--kind", "cpu", "--mbs", "1", "-o", str(other)])
    assert res.exit_code == 2 and "layer sizes" in res.output, res.output
    assert "tp=2 in bf16" in res.output, res.output
    # ... and one whose tp=2 layers were timed before the engine split the vocabulary, at a
    # microbatch size this run does not re-measure (its split stamp would tag them)
    held |= {"tp": 2, "source": "measured"}
    other.write_text(
        json.dumps({"model": "tiny-gpt", "timings": [{**held, **times, "precision": "fp32"}]})
    )
    res = runner.invoke(
        app, ["profile", "layers", "--kind", "cpu", "--tp", "2", "--mbs", "1", "-o", str(other)]
    )
    assert res.exit_code == 2 and "cpu.tp2.vocab_parallel" in res.output, res.output
    assert "tp=2 mbs=4" in res.output, res.output
    other.write_text("{")
    res = runner.invoke(app, ["profile", "network", "--collectives", "", "-o", str(other)])
    assert res.exit_code == 2 and "other.json" in res.output, res.output


def test_calibration_has_a_schema() -> None:
    res = runner.invoke(app, ["schema", "calibration"])
    assert res.exit_code == 0 and '"prior"' in res.stdout


def test_log_lines_go_to_stderr_not_into_json_output() -> None:
    """``sailor check --json`` printed the NATS client's log lines into its JSON."""
    import contextlib
    import io
    import json

    import structlog

    from sailor.cli.main import _logs_to_stderr

    _logs_to_stderr()
    try:
        log = structlog.get_logger()
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            log.info("hello")
        assert "hello" in err.getvalue() and out.getvalue() == ""
    finally:
        structlog.reset_defaults()
    res = runner.invoke(app, ["schema", "pool"])
    json.loads(res.stdout)


def test_simulate_spot_flag_overrides_the_plans_own_flags(tmp_path: Path) -> None:
    """The planner writes ``spot`` on every replica group, so a plain bool option was a
    no-op on its plans: unset now means the plan's flags, --spot/--on-demand override them."""
    import json

    from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

    rg = ReplicaGroup(gpu_type="A100-40", zone="us-central1-a", tp=1, gpus_per_node=4, spot=True)
    pipe = Pipeline(
        stages=(Stage(first_layer=0, last_layer=25, replica=rg),),
        microbatch_size=2,
        num_microbatches=128,
    )
    f = tmp_path / "plan.json"
    plan = Plan(model="OPT-350", global_batch_size=1024, pipelines=(pipe,) * 4)
    f.write_text(plan.model_dump_json())

    def cost(*flags: str) -> float:
        res = runner.invoke(app, ["simulate", str(f), "--json", *flags])
        assert res.exit_code == 0, res.output
        return float(json.loads(res.stdout)["cost_per_iter_usd"])

    as_planned, on_spot, on_demand = cost(), cost("--spot"), cost("--on-demand")
    assert as_planned == on_spot < on_demand


def test_a_bad_stage_is_one_error_not_also_an_empty_stage_list(tmp_path: Path) -> None:
    """pydantic adds "at least 1 item after validation, not 0" to a tuple whose only item
    failed: a follow-on of the item's own error, not a second problem."""
    import json

    from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

    rg = ReplicaGroup(gpu_type="A100-40", zone="us-central1-a", tp=1, gpus_per_node=4)
    stage = Stage(first_layer=0, last_layer=25, replica=rg)
    pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=8)
    d = json.loads(Plan(model="OPT-350", global_batch_size=8, pipelines=(pipe,)).model_dump_json())
    d["pipelines"][0]["stages"][0]["replica"]["tp"] = 3
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    res = runner.invoke(app, ["simulate", str(f)])
    assert res.exit_code != 0 and "tp=3: must be a power of two" in res.output, res.output
    assert "at least 1 item" not in res.output


def test_a_zone_the_price_table_does_not_know_is_named(tmp_path: Path) -> None:
    """Prices fall back to another region's for an unknown zone: a misspelt zone was priced
    elsewhere without a word. The plan still runs; a warning names the entry."""
    pool = tmp_path / "pool.yaml"
    pool.write_text(
        "entries:\n  - {gpu_type: A100-40, zone: mars-1a, nodes: 1, gpus_per_node: 4}\n"
    )
    res = runner.invoke(
        app, ["plan", "--model", "OPT-350", "--pool", str(pool), "--risk", "median"]
    )
    assert res.exit_code == 0, res.output
    assert "warning: pool entry A100-40 in zone 'mars-1a'" in res.stderr
    ok = tmp_path / "ok.yaml"
    ok.write_text(pool.read_text().replace("mars-1a", "us-central1-a"))
    res = runner.invoke(app, ["plan", "--model", "OPT-350", "--pool", str(ok), "--risk", "median"])
    assert res.exit_code == 0 and "warning" not in res.stderr
    # simulate warns the same for the zones of a plan's stages
    plan = tmp_path / "plan.json"
    res = runner.invoke(
        app,
        ["plan", "--model", "OPT-350", "--pool", str(pool), "--risk", "median", "-o", str(plan)],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["simulate", str(plan)])
    assert res.exit_code == 0, res.output
    assert "warning: plan stage A100-40 in zone 'mars-1a'" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "args,want",
    [
        (["ckpt", "gc", "{tmp}", "--keep", "0"], "--keep"),
        (["ckpt", "gc", "{tmp}", "--grace", "nan"], "--grace"),
        (["ckpt", "gc", "{tmp}", "--grace", "-100"], "--grace"),
        (["certs", "init", "{tmp}/ca", "--days", "100000000"], "--days"),
        (["certs", "init", "{tmp}/ca", "--days", "0"], "--days"),
    ],
)
def test_out_of_range_values_are_refused_by_name(
    tmp_path: Path, args: list[str], want: str
) -> None:
    """Each was accepted (gc's grace) or ended in a traceback ('a bug?': gc's keep 0, the
    certificate's OverflowError)."""
    res = runner.invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert res.exit_code == 2 and want in res.output, res.output
    assert "a bug?" not in res.output and not (tmp_path / "ca").exists()


@pytest.mark.parametrize(
    "entry,want",
    [
        ("nodes: 1000000000000, gpus_per_node: 4", "nodes"),  # MemoryError in the planner
        ("nodes: true, gpus_per_node: 4", "nodes"),  # planned as 1 node before
        ("nodes: 2, gpus_per_node: 4, spot: 'yes'", "spot"),  # coerced to spot before
        ("nodes: 2, gpus_per_node: 1000", "gpus_per_node"),
        ("zone: 'us central1 a'", "zone"),  # planned, with a warning, before
        ("zone: ''", "zone"),
    ],
)
def test_pool_values_out_of_reach_or_of_the_wrong_type(
    tmp_path: Path, entry: str, want: str
) -> None:
    pool = tmp_path / "pool.yaml"
    zone = "us-central1-a"
    if entry.startswith("zone:"):
        zone, entry = entry.removeprefix("zone:").strip(), "nodes: 2, gpus_per_node: 4"
    pool.write_text(f"entries:\n  - {{gpu_type: A100-40, zone: {zone}, {entry}}}\n")
    res = runner.invoke(app, ["plan", "--model", "OPT-350", "--pool", str(pool)])
    assert res.exit_code == 2 and want in res.output, res.output
    assert "a bug?" not in res.output


def test_batch_and_depth_out_of_reach_are_refused_by_name(tmp_path: Path) -> None:
    """``--gbs 10**12`` hung the search; a million layers filled memory."""
    pool = tmp_path / "pool.yaml"
    pool.write_text(
        "entries:\n  - {gpu_type: A100-40, zone: us-central1-a, nodes: 2, gpus_per_node: 4}\n"
    )
    res = runner.invoke(
        app, ["plan", "--model", "OPT-350", "--pool", str(pool), "--gbs", str(10**12)]
    )
    assert res.exit_code == 2 and "--gbs" in res.output, res.output
    spec = catalog.model("OPT-350").model_dump()
    spec["num_layers"] = 1_000_000
    model = tmp_path / "model.json"
    model.write_text(json.dumps(spec))
    res = runner.invoke(app, ["plan", "--model", str(model), "--pool", str(pool)])
    assert res.exit_code == 2 and "num_layers" in res.output, res.output


def test_outputs_are_checked_before_the_work(tmp_path: Path) -> None:
    """A Pareto plot to a directory or a .txt name failed after the whole search (or wrote
    ``dir.png`` and said ``dir``); ``-o`` a directory left ``dir.tmp`` behind; a type capped
    twice kept the first cap silently."""
    pool = tmp_path / "pool.yaml"
    pool.write_text(
        "entries:\n  - {gpu_type: A100-40, zone: us-central1-a, nodes: 2, gpus_per_node: 4}\n"
    )
    base = ["plan", "--model", "OPT-350", "--pool", str(pool)]
    for out, want in ((tmp_path, "is a directory"), (tmp_path / "p.txt", "ending in .png")):
        res = runner.invoke(app, [*base, "--pareto", str(out)])
        assert res.exit_code == 2 and f"--pareto {out}: " in res.output and want in res.output
    res = runner.invoke(app, [*base, "--max-gpus", "A100-40=4", "--max-gpus", "A100-40=1"])
    assert res.exit_code == 2 and "capped twice" in res.output, res.output
    dest = tmp_path / "dir"
    dest.mkdir()
    res = runner.invoke(app, [*base, "--risk", "median", "-o", str(dest)])
    assert res.exit_code == 2 and "is a directory" in res.output, res.output
    assert not (tmp_path / "dir.tmp").exists()
    plan = tmp_path / "plan.json"
    res = runner.invoke(app, [*base, "--risk", "median", "-o", str(plan)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["simulate", str(plan), "--timeline", str(tmp_path / "t")])
    assert res.exit_code == 2 and "ending in .png" in res.output, res.output
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("argv", [["schema", "plan"], ["catalog", "gpus"]], ids=["echo", "rich"])
def test_a_reader_that_went_away_ends_the_command_quietly(argv: list[str]) -> None:
    """``sailor schema plan | head -1``: the write into the closed pipe ends the command with
    128 + SIGPIPE and prints nothing (it printed a "BrokenPipeError (a bug?)" line). A rich
    table (``catalog gpus``, ``plan``, ``simulate``) ended with rich's own exit 1 instead."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        res = subprocess.run(
            [sys.executable, "-m", "sailor.cli.main", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert res.returncode == 141, res.stderr
    assert res.stderr == ""


_INTERRUPT_AT_IMPORT = """
import importlib, os, signal, sys, tomllib

class Interrupt:
    # Ctrl-C while ``sailor.cli.main`` imports its sub-commands (seconds on a busy machine)
    def find_spec(self, name, path=None, target=None):
        if name == "sailor.cli.catalog_cmd":
            os.kill(os.getpid(), signal.SIGINT)
        return None

script = tomllib.load(open(sys.argv[1], "rb"))["project"]["scripts"]["sailor"]
module, _, func = script.partition(":")
sys.meta_path.insert(0, Interrupt())
sys.argv = ["sailor", "catalog", "gpus"]
getattr(importlib.import_module(module), func)()
"""


def test_ctrl_c_during_the_start_up_imports_is_one_line_and_130() -> None:
    """The console script was ``sailor.cli.main:app``: a Ctrl-C while that module imports
    every sub-command (5-10 s on a busy machine) came before any handler and printed
    Python's traceback. The script's entry (read from pyproject.toml, as pip installs it)
    now ends with one line and 128 + SIGINT."""
    import signal

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    res = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_AT_IMPORT, str(pyproject)],
        capture_output=True,
        text=True,
        timeout=120,
        # the child's ^C is Python's KeyboardInterrupt even where this runner ignores SIGINT
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert res.returncode == 130, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr == "interrupted (Ctrl-C)\n", res.stderr
    assert res.stdout == ""


def test_ctrl_c_during_a_command_is_one_line_and_130() -> None:
    """A Ctrl-C while a command ran ended with typer's exit 130 and no word at all."""
    from sailor.cli.errors import OneLineErrors

    cli = typer.Typer(cls=OneLineErrors)

    @cli.command("wait")
    def wait() -> None:
        raise KeyboardInterrupt

    @cli.command("other")
    def other() -> None:  # a group of two: ``wait`` is a sub-command, as in ``sailor``
        pass

    res = runner.invoke(cli, ["wait"])
    assert res.exit_code == 130, res.output
    assert res.stderr == "interrupted (Ctrl-C)\n", repr(res.stderr)
    assert "Traceback" not in res.output
