"""Merge new profiles into a profile database file: the better source wins, then the newer.

Rules, per key (timings: GPU type, TP, microbatch size, layer; sizes: TP, layer; overheads:
GPU type, TP):

* a better source replaces a worse one: ``measured`` > ``imported`` > ``estimated``;
* between equal sources the new entry replaces the old one (a re-run of the profiler
  overwrites its previous figures, an estimate re-made with more GPUs replaces the old one);
* a worse new entry never replaces a better old one: an estimate merged into a database
  that holds a measurement at the same key is dropped;
* overheads and framework times (measured by definition) are replaced by the new one of
  the same key (GPU type, TP / GPU type); per-layer memory footprints of both are kept;
* ``meta`` is the union, the new values winning; except ``<gpu>.skipped`` (units a run
  skipped): the old run's units stay listed until a run measures them.

Unlike :meth:`ProfileDB.merged` (which keeps both entries and picks at query time), the
result holds one entry per key, so a file does not grow with every re-run.

Pure except :func:`load_db` / :func:`save_db`, which read and write JSON (atomically and
durably).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from sailor.durable import write_durably
from sailor.schemas import LayerProfile, LayerSize, ProfileDB
from sailor.schemas.profile import VOCAB_SPLIT_META, DeviceOverhead

__all__ = [
    "SKIPPED",
    "SOURCE_RANK",
    "load_db",
    "merge_db",
    "precision_clash",
    "save_db",
    "split_clash",
]

SOURCE_RANK: dict[str, int] = {"measured": 0, "imported": 1, "estimated": 2}
"""Lower is better."""

SKIPPED = ".skipped"
"""Suffix of the ``meta`` key (``<gpu>.skipped``) naming the (TP, mbs) units a layer profile
skipped (out of GPU memory), JSON ``{"tp2.mbs8": cause}``."""

_E = TypeVar("_E", LayerProfile, LayerSize)


def _merge_entries(old: tuple[_E, ...], new: tuple[_E, ...]) -> tuple[tuple[_E, ...], int]:
    """Entries of both with one per key; also how many new entries were dropped."""

    def k(e: _E) -> tuple[object, ...]:
        if isinstance(e, LayerProfile):
            return (e.gpu_type, e.tp, e.microbatch_size, e.layer)
        return (e.tp, e.layer)

    out: dict[tuple[object, ...], _E] = {}
    for e in old:
        cur = out.get(k(e))
        if cur is None or SOURCE_RANK[e.source] <= SOURCE_RANK[cur.source]:
            out[k(e)] = e
    dropped = 0
    for e in new:
        cur = out.get(k(e))
        if cur is None or SOURCE_RANK[e.source] <= SOURCE_RANK[cur.source]:
            out[k(e)] = e
        else:
            dropped += 1
    return tuple(out[x] for x in sorted(out, key=repr)), dropped


def merge_db(old: ProfileDB | None, new: ProfileDB) -> tuple[ProfileDB, int]:
    """``new`` merged into ``old`` by the rules above; also the number of new entries dropped
    because a better source already held their key."""
    if old is None:
        old = ProfileDB(model=new.model)
    if old.model != new.model:
        raise ValueError(f"model={new.model!r}: cannot merge into profiles of {old.model!r}")
    for g in sorted({t.gpu_type for t in new.timings if t.source == "measured"}):
        units = {(t.tp, t.microbatch_size) for t in new.timings if t.gpu_type == g}
        why = _split_clash(old, new.meta, g, units)
        if why:
            raise ValueError(why)
    timings, d1 = _merge_entries(old.timings, new.timings)
    sizes, d2 = _merge_entries(old.sizes, new.sizes)
    over: dict[tuple[str, int], DeviceOverhead] = {(o.gpu_type, o.tp): o for o in old.overheads}
    for o in new.overheads:
        over[(o.gpu_type, o.tp)] = o
    frame = {f.gpu_type: f for f in old.framework}
    for f in new.framework:
        frame[f.gpu_type] = f
    hosts = {h.gpu_type: h for h in old.hosts}
    for h in new.hosts:
        hosts[h.gpu_type] = h
    merged = ProfileDB(
        model=old.model,
        timings=timings,
        sizes=sizes,
        overheads=tuple(over[k] for k in sorted(over)),
        framework=tuple(frame[k] for k in sorted(frame)),
        hosts=tuple(hosts[k] for k in sorted(hosts)),
        memory=tuple(dict.fromkeys(old.memory + new.memory)),
        meta=_merge_meta(old, new),
    )
    return merged, d1 + d2


def precision_clash(
    old: ProfileDB | None,
    gpu_type: str,
    units: Iterable[tuple[int, int]],
    precision: str,
    sizes: bool = False,
) -> str:
    """Why a run measuring ``gpu_type`` in ``precision`` at ``units`` ((TP, mbs) pairs) would
    leave ``old`` with layers of one TP degree in two precisions; '' when it would not.

    The simulator reads one precision per GPU type and TP degree and scales every entry of
    it from there (``simulator.lookup``): an fp32 run at mbs 1 merged into a bf16 profile of
    mbs 1 and 2 had the bf16 mbs-2 times read as fp32 and scaled ~6x too fast. A database
    holding both is refused when it is built (``ProfileDB``); this says so before the
    measurement, naming the entries in the way. Entries at the run's own units are replaced
    by it, and estimated ones are not read beside measured ones: neither is in the way.

    ``sizes``: the run also writes layer sizes (``profiler.precision.sizes_measured``). Sizes
    are per model (TP, layer), read for every GPU type, and a database holds them in one
    precision: measured or imported sizes of another precision at a TP degree the run does
    not measure are in the way too."""
    if old is None:
        return ""
    todo = set(units)
    tps = {tp for tp, _ in todo}
    if sizes:
        other = sorted(
            {
                (s.tp, s.precision)
                for s in old.sizes
                if s.tp not in tps
                and s.source != "estimated"
                and s.precision is not None
                and s.precision != precision
            }
        )
        if other:
            held = ", ".join(f"tp={tp} in {p}" for tp, p in other)
            return (
                f"precision={precision!r}: the file holds layer sizes this run does not "
                f"replace, measured in another precision ({held}); sizes are per model and "
                "price every GPU type's memory, in one precision per file: write this run to "
                "another file, or measure those TP degrees too"
            )
    clash = sorted(
        {
            (t.tp, t.microbatch_size, t.precision)
            for t in old.timings
            if t.gpu_type == gpu_type
            and t.tp in tps
            and t.source != "estimated"
            and t.precision is not None
            and t.precision != precision
            and (t.tp, t.microbatch_size) not in todo
        }
    )
    if not clash:
        return ""
    held = ", ".join(f"tp={tp} mbs={m} in {p}" for tp, m, p in clash)
    return (
        f"precision={precision!r}: the file holds {gpu_type} layers this run does not "
        f"replace, measured in another precision ({held}); the simulator reads one precision "
        "per GPU type and TP degree: write this run to another file, or measure those "
        "microbatch sizes too"
    )


def split_clash(old: ProfileDB | None, gpu_type: str, units: Iterable[tuple[int, int]]) -> str:
    """Why a run of Sailor's profiler measuring ``gpu_type`` at ``units`` ((TP, mbs) pairs)
    would leave ``old`` with a vocabulary-split stamp over layers it does not replace; ''
    when it would not.

    A run stamps ``<gpu>.tp<t>.vocab_parallel`` at each TP degree it measures (the engine
    splits the embedding and head by vocabulary); measured TP > 1 layers without the stamp
    timed an older engine's whole head (``simulator.lookup.measured_whole_ends``). The stamp
    is one per GPU type and TP degree: merged over such layers at a microbatch size the run
    does not re-measure, it would tag their whole head as split. Said before the
    measurement, naming them; :func:`merge_db` refuses the same."""
    if old is None:
        return ""
    units = set(units)
    stamps = {f"{gpu_type}.tp{tp}.{VOCAB_SPLIT_META}": "true" for tp, _ in units}
    return _split_clash(old, stamps, gpu_type, units)


def _split_clash(
    old: ProfileDB, new_meta: dict[str, str], gpu_type: str, units: set[tuple[int, int]]
) -> str:
    whole = sorted(
        {
            (t.tp, t.microbatch_size)
            for t in old.timings
            if t.gpu_type == gpu_type
            and t.tp > 1
            and t.source == "measured"
            and (t.tp, t.microbatch_size) not in units
            and f"{gpu_type}.tp{t.tp}.{VOCAB_SPLIT_META}" in new_meta
            and f"{gpu_type}.tp{t.tp}.{VOCAB_SPLIT_META}" not in old.meta
        }
    )
    if not whole:
        return ""
    held = ", ".join(f"tp={tp} mbs={m}" for tp, m in whole)
    return (
        f"{gpu_type}.tp{whole[0][0]}.{VOCAB_SPLIT_META}: the file holds {gpu_type} layers "
        f"this run does not replace, measured before the engine split the embedding and head "
        f"by vocabulary ({held}); the run's split stamp is one per GPU type and TP degree "
        "and would tag their whole head as split: measure those microbatch sizes too, or "
        "write this run to another file"
    )


def _merge_meta(old: ProfileDB, new: ProfileDB) -> dict[str, str]:
    """The union of both ``meta``, the new values winning; but ``<gpu>.skipped`` (the (TP,
    mbs) units a run could not measure, :mod:`layers`) keeps the old run's units the new run
    neither measured nor skipped, and is dropped once every one of them is measured."""
    meta = {**old.meta, **new.meta}
    for g in {t.gpu_type for t in new.timings if t.source == "measured"} | {
        k.removesuffix(SKIPPED) for k in new.meta if k.endswith(SKIPPED)
    }:
        key = g + SKIPPED
        if key not in old.meta:
            continue
        done = {
            f"tp{t.tp}.mbs{t.microbatch_size}"
            for t in new.timings
            if t.gpu_type == g and t.source == "measured"
        }
        units = {u: why for u, why in json.loads(old.meta[key]).items() if u not in done}
        units.update(json.loads(new.meta.get(key, "{}")))
        if units:
            meta[key] = json.dumps(units, sort_keys=True)
        else:
            del meta[key]
    return meta


def load_db(path: Path) -> ProfileDB | None:
    """The database in ``path``, or None if there is no such file."""
    if not path.exists():
        return None
    return ProfileDB.model_validate_json(path.read_text())


def save_db(db: ProfileDB, path: Path) -> None:
    """Write ``db`` to ``path`` atomically and durably (:func:`sailor.durable.write_durably`:
    a temporary file fsync'd, renamed, the directory fsync'd where the file system can),
    making its directories."""
    text = db.model_dump_json(indent=1) + "\n"
    write_durably(path, text.encode(), make_dirs=True, skip_unsupported=True)
