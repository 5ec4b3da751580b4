"""Reading a wire message written by a newer release: drop the fields this one does not know.

During a rolling upgrade, daemons of two releases read each other's messages (etcd records,
NATS events and commands, checkpoint manifests). The rule (docs/runtime.md, "Wire
versions"): a release that adds a field to a wire message gives it a default and raises
``SCHEMA_VERSION``; a change that is not additive (a rename, a new meaning, a new required
field) takes a new field or a new message. A reader then validates a message of a newer
version after removing every key that no field of its own schema (or of the models nested
in it) knows: a newer writer's additions are ignored, what both know is still checked
strictly. At this release's version or older, an unknown key stays an error (a typo, or a
writer that did not raise the version).

Pure: :func:`drop_unknown` returns the pruned data and the dotted paths it removed.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

__all__ = ["drop_unknown"]


def _is_model(t: Any) -> bool:
    return inspect.isclass(t) and issubclass(t, BaseModel)


def _literal_values(t: Any) -> set[Any] | None:
    if typing.get_origin(t) is typing.Literal:
        return set(typing.get_args(t))
    return None


def _pick_model(models: list[type[BaseModel]], data: Mapping[str, Any]) -> type[BaseModel] | None:
    """The one model of a union whose literal fields (a discriminator such as ``kind``)
    agree with ``data``; None when that is not exactly one."""
    if len(models) == 1:
        return models[0]
    fits = []
    for m in models:
        ok = True
        for name, f in m.model_fields.items():
            lit = _literal_values(f.annotation)
            if lit is not None and name in data and data[name] not in lit:
                ok = False
                break
        if ok:
            fits.append(m)
    return fits[0] if len(fits) == 1 else None


def _prune(t: Any, value: Any, path: str, dropped: list[str]) -> Any:
    """``value`` read as type ``t``, with unknown keys of every model in it removed."""
    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if origin is typing.Annotated:
        return _prune(args[0], value, path, dropped)
    if _is_model(t):
        return _prune_model(t, value, path, dropped)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if _is_model(a)]
        if isinstance(value, Mapping) and models:
            m = _pick_model(models, value)
            if m is not None:
                return _prune_model(m, value, path, dropped)
        others = [a for a in args if not _is_model(a) and a is not type(None)]
        if len(others) == 1 and not models:
            return _prune(others[0], value, path, dropped)
        return value
    if origin in (dict, Mapping) or (inspect.isclass(origin) and issubclass(origin, Mapping)):
        if isinstance(value, Mapping) and len(args) == 2:
            return {k: _prune(args[1], v, f"{path}.{k}", dropped) for k, v in value.items()}
        return value
    if origin in (tuple, list, frozenset, set) or (
        inspect.isclass(origin) and issubclass(origin, Sequence)
    ):
        if not isinstance(value, list | tuple) or not args:
            return value
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                return value
            pairs = enumerate(zip(args, value, strict=True))
            return [_prune(a, v, f"{path}[{i}]", dropped) for i, (a, v) in pairs]
        return [_prune(args[0], v, f"{path}[{i}]", dropped) for i, v in enumerate(value)]
    return value


def _prune_model(model: type[BaseModel], value: Any, path: str, dropped: list[str]) -> Any:
    if not isinstance(value, Mapping):
        return value
    out: dict[str, Any] = {}
    for k, v in value.items():
        f = model.model_fields.get(k) if isinstance(k, str) else None
        where = f"{path}.{k}" if path else str(k)
        if f is None:
            dropped.append(where)
            continue
        out[k] = _prune(f.annotation, v, where, dropped)
    return out


def drop_unknown(
    model: type[BaseModel], data: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """``data`` (a message of ``model``) without the keys ``model`` and the models nested in
    its fields do not know; the dotted paths of the keys removed."""
    dropped: list[str] = []
    out = _prune_model(model, data, "", dropped)
    return out, dropped
