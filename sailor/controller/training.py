"""The controller's training config: read, validated and anchored once, at start.

``ControllerConfig.training`` names a ``TrainingConfig`` file. :func:`load_training` reads it,
validates it (``parse_training_config``: every problem as ``FILE: field=value: why``) and
makes its relative paths absolute against the file's directory (``anchor_training_paths``),
so the one config the controller hands to every worker means the same files on every node.
A file that cannot be read or is invalid raises :class:`TrainingConfigError` before the
controller connects to anything: a job must not launch workers on a config they would refuse
one by one. Must never import torch or the agent.
"""

from __future__ import annotations

from pathlib import Path

from sailor.schemas.training import TrainingConfig, parse_training_config
from sailor.schemas.training_paths import anchor_training_paths

__all__ = ["TrainingConfigError", "check_checkpoint_dirs", "load_training"]


class TrainingConfigError(ValueError):
    """The training config cannot be used; the message names the file, field and value.
    Not retried: the file must be fixed."""


def load_training(path: Path) -> TrainingConfig:
    """The config of ``path`` (relative: to the working directory), paths made absolute."""
    path = path.absolute()
    try:
        text = path.read_text()
    except OSError as exc:
        raise TrainingConfigError(
            f"{path}: cannot read the training config ({exc.strerror or exc})"
        ) from exc
    try:
        config = parse_training_config(text, str(path))
    except ValueError as exc:
        raise TrainingConfigError(str(exc)) from exc
    return anchor_training_paths(config, path.parent.as_posix())


def _same_root(a: str, b: str) -> bool:
    """Whether two checkpoint roots are one directory (a local path, ``file://`` or not,
    resolved: the controller reads its config before anything can hang), or one URL.

    The same *directory*, not the same storage: the retention of one deletes the other's
    commits only when both list the same step directories. Two directories of one mount
    do not collide here; the worker's rule for a write hung on a mount
    (``sailor.checkpoint.mounts``) asks another question (would a write there hang too)."""

    def local(root: str) -> str | None:
        r = root[len("file://") :] if root.startswith("file://") else root
        return None if "://" in r else r

    la, lb = local(a), local(b)
    if la is None or lb is None:
        return la is None and lb is None and a.rstrip("/") == b.rstrip("/")
    return Path(la).absolute().resolve() == Path(lb).absolute().resolve()


def check_checkpoint_dirs(path: Path, checkpoint_dir: str, training: TrainingConfig) -> None:
    """The training config's periodic checkpoints (``checkpoint.dir``) may not share the
    controller's ``checkpoint_dir``: their retention keeps the newest ``keep`` commits it
    finds on disk and would delete the checkpoint the controller recorded and resumes from
    (the controller prunes only below what it recorded)."""
    d = training.checkpoint.dir
    if d is not None and _same_root(d, checkpoint_dir):
        raise TrainingConfigError(
            f"{path}: checkpoint.dir={d!r} is the controller's checkpoint_dir "
            f"({checkpoint_dir!r}): give the periodic checkpoints a directory of their own "
            "(their retention would delete the checkpoint the controller resumes from)"
        )
