"""Reading and writing schema files (JSON or YAML) for the CLI, with errors that name the file."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import typer
import yaml
from pydantic import BaseModel, ValidationError

from sailor.cli.errors import CliError
from sailor.cli.schema_names import SCHEMAS
from sailor.durable import write_durably
from sailor.schemas.calibration import Calibration
from sailor.schemas.deployment import Deployment
from sailor.schemas.prices import PriceTable
from sailor.schemas.redact import redact_text

__all__ = [
    "DEPLOYMENT_HELP",
    "check_out",
    "check_png_out",
    "fail",
    "fail_unanswered",
    "load_config",
    "load_deployment",
    "load_model",
    "load_raw",
    "priced_for",
    "run_request",
    "warn_unpriced",
    "write_json",
]

DEPLOYMENT_HELP = (
    "Deployment to price: a catalog name (sailor: Sailor's engine, the built-in "
    "calibration's; megatron-deepspeed: the framework of the GH200 fit) or a Deployment file "
    "(`sailor schema deployment`). Default: the calibration's own structure."
)

M = TypeVar("M", bound=BaseModel)
A = TypeVar("A")


def fail(msg: str, code: int = 2) -> CliError:
    """The error to raise: the CLI entry (:mod:`sailor.cli.errors`) prints ``error: MSG``
    as one line on stderr and exits with ``code``."""
    return CliError(msg, code)


def fail_unanswered(
    outcome: str, rid: str, wait_s: float, where: str, record: str, unchanged: str
) -> None:
    """Raise the error of an operator request that was not applied, or not known to be
    (``outcome``: unwritten, unconfirmed, unknown, withdrawn); return for any other.
    ``where``: the request's etcd key prefix; ``record``: its audit record's kind;
    ``unchanged``: what did not happen ("nothing was readmitted")."""
    if outcome == "unwritten":
        raise fail(
            f"etcd took no write of request {rid} within {wait_s:g} s ({unchanged}): is etcd up?",
            code=1,
        )
    if outcome == "unconfirmed":
        raise fail(
            f"etcd lost its answer to the write of request {rid} and did not answer again: "
            f"the request may wait under {where}/{rid}, or have been applied; see "
            f"`sailor status` and the leader's audit log (`{record}`)",
            code=1,
        )
    if outcome == "unknown":
        raise fail(
            f"etcd failed while request {rid} was withdrawn after {wait_s:g} s: it may have "
            f"been applied, or may still wait under {where}/{rid}; see `sailor status` and "
            f"the leader's audit log (`{record}`, `request_withdrawn` or `request_unknown`)",
            code=1,
        )
    if outcome == "withdrawn":
        raise fail(
            f"no controller answered within {wait_s:g} s (request {rid} withdrawn: "
            f"{unchanged}): is a controller running for this job?",
            code=1,
        )


def run_request(request: Coroutine[Any, Any, A]) -> A:
    """Run an operator request (``status.request_readmit``, ``request_clear_bad``) to its
    answer; one that etcd failed before it was written (``NotWrittenError``) is the
    command's one-line error, naming the endpoints, etcd's error and that nothing was
    written (exit 1), not the generic "temporary: retry"."""
    from sailor.controller.status import NotWrittenError

    try:
        return asyncio.run(request)
    except NotWrittenError as exc:
        raise fail(str(exc), code=1) from exc


def _schema_hint(cls: type[BaseModel]) -> str:
    names = [n for n, c in SCHEMAS.items() if c is cls]
    return f"see `sailor schema {names[0]}`" if names else "fix the field(s) named"


def load_raw(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise fail(f"{path}: cannot read ({exc.strerror or exc}): check the path") from exc
    except UnicodeDecodeError as exc:
        raise fail(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start : exc.start + 1]!r}):"
            " pass a JSON or YAML file"
        ) from exc
    if not text.strip():
        raise fail(f"{path}: the file is empty: pass a file with content")
    try:
        if path.suffix in (".yaml", ".yml"):
            return yaml.safe_load(text)
        return json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        raise fail(f"{path}: not valid {kind}: {exc}: fix the syntax") from exc
    except RecursionError as exc:  # the parsers' own depth limit
        raise fail(f"{path}: nested too deep to read: fix the file") from exc


def _validate(path: Path, raw: Any, cls: type[M]) -> M:
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        locs = [tuple(e["loc"]) for e in errors]

        def follow_on(e: Any) -> bool:
            # "at least 1 item after validation, not 0": the items inside failed, each
            # reported on its own
            loc = tuple(e["loc"])
            return e["type"] == "too_short" and any(
                len(x) > len(loc) and x[: len(loc)] == loc for x in locs
            )

        fields = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']} "
            f"(got {redact_text(repr(e.get('input'))):.60})"  # no URL's password, even cut
            for e in errors
            if not follow_on(e)
        )
        raise fail(f"{path}: not a valid {cls.__name__}: {fields}: {_schema_hint(cls)}") from exc


def load_model(path: Path, cls: type[M]) -> M:
    """Validate a file against a schema; on failure name the file, each field and value."""
    return _validate(path, load_raw(path), cls)


def load_config(path: Path, cls: type[M]) -> M:
    """A daemon's config (YAML, TOML or JSON, by suffix; YAML otherwise), errors naming it."""
    import tomllib

    from sailor.controller.config import load_mapping

    try:
        raw = load_mapping(path)
    except OSError as exc:
        raise fail(f"{path}: cannot read ({exc.strerror or exc}): check the path") from exc
    except (ValueError, yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        msg = str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}"
        raise fail(f"{msg}: a mapping of the config's fields is expected") from exc
    return _validate(path, raw, cls)


def load_deployment(spec: str) -> Deployment:
    """A catalog deployment by name, else a Deployment file; the error names both."""
    from sailor import catalog

    if spec in catalog.deployments():
        return catalog.deployment(spec)
    path = Path(spec)
    if path.suffix in (".json", ".yaml", ".yml") or path.exists():
        return load_model(path, Deployment)
    raise fail(
        f"--deployment {spec!r}: neither a catalog deployment "
        f"({', '.join(catalog.deployments())}) nor a Deployment file"
    )


def priced_for(
    cal: Calibration, deployment: Deployment | None
) -> tuple[Calibration, dict[str, Any]]:
    """``cal`` pricing ``deployment``'s structure (None: its own), and what ``--json``
    reports of it: the deployment's name (``calibration`` for its own) and structure."""
    if deployment is not None:
        cal = cal.with_deployment(deployment)
    name = deployment.name if deployment is not None else "calibration"
    return cal, {"name": name, **cal.structure()}


def write_json(obj: BaseModel | dict[str, Any] | list[Any], path: Path | None) -> None:
    """Write to ``path`` (atomically and durably: :func:`sailor.durable.write_durably`; on a
    file system that cannot fsync a directory, as durably as it makes a rename) or print to
    stdout."""
    text = (
        obj.model_dump_json(indent=2) if isinstance(obj, BaseModel) else json.dumps(obj, indent=2)
    )
    if path is None:
        typer.echo(text)
        return
    if path.is_dir():
        raise fail(f"{path}: is a directory: give a file name")
    try:
        write_durably(path, (text + "\n").encode(), make_dirs=True, skip_unsupported=True)
    except OSError as exc:
        raise fail(f"{path}: cannot write ({exc.strerror or exc})") from exc


def check_out(path: Path | None, option: str, what: str = "a file name") -> None:
    """Before the work whose result it takes: ``path`` is not a directory and its folder
    exists (made if need be) and takes a new file, so that a search or a measurement does
    not end on an output that was never writable. The probe file is removed."""
    if path is None:
        return
    if path.is_dir():
        raise fail(f"{option} {path}: is a directory: give {what}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise fail(
            f"{option} {path}: cannot write in {path.parent} ({exc.strerror or exc}): "
            "give a writable path"
        ) from exc


def check_png_out(path: Path | None, option: str) -> None:
    """Before the work whose picture it is: ``path`` can take a PNG (matplotlib would add
    ``.png`` to a name without it, or fail on another suffix, after the work)."""
    if path is None:
        return
    if path.is_dir():
        raise fail(f"{option} {path}: is a directory: give a .png file name")
    if path.suffix.lower() != ".png":
        raise fail(f"{option} {path}: the picture is a PNG: give a file name ending in .png")
    check_out(path, option, "a .png file name")


def warn_unpriced(prices: PriceTable, where: Sequence[tuple[str, str]], what: str) -> None:
    """A warning on stderr for each (GPU type, zone) the price table has no price for, in
    the zone or its region: it is priced at another region's rate (a misspelt zone?)."""
    from sailor.schemas.zones import region_of

    for gpu_type, zone in where:
        if not prices.priced_where(gpu_type, zone):
            typer.echo(
                f"warning: {what} {gpu_type} in zone {zone!r}: the price table has no "
                f"price there or in its region ({region_of(zone)!r}): priced at another "
                "region's rate (a misspelt zone?)",
                err=True,
            )
