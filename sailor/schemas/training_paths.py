"""Anchoring a training config's relative paths to a directory: :func:`anchor_training_paths`.

A ``TrainingConfig`` names files — the data set and its manifest, a ModelSpec file, a Hugging
Face directory, the checkpoint root, the metrics outputs — relative to the file it was read
from. The controller reads that file once and hands the config to workers on other nodes, in
other run directories; so it makes each such path absolute against the file's directory
first, and every rank then reads and writes the same paths wherever it runs.

Kept as they are: absolute paths, URLs (``scheme://...``: a checkpoint root may be an fsspec
URL) and ``None``. Paths are joined, not normalised (``..`` stays: resolving it would read
the file system, and a symlinked directory makes the two differ). Applying it twice changes
nothing.

Pure: no file system access, no working directory; the caller gives an absolute base.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from sailor.schemas._base import field_error
from sailor.schemas.training import HuggingFaceModel, IndexedData, SpecFileModel, TrainingConfig

__all__ = ["anchor_training_paths"]


def _anchored(base: PurePosixPath, path: str | None) -> str | None:
    if path is None or "://" in path or PurePosixPath(path).is_absolute():
        return path
    return str(base / path)


def anchor_training_paths(config: TrainingConfig, base_dir: str | PurePosixPath) -> TrainingConfig:
    """``config`` with every relative path made absolute against ``base_dir`` (absolute).

    The paths: ``model.path`` (spec file or Hugging Face directory), ``data.prefix`` and
    ``data.manifest``, ``checkpoint.dir``, ``metrics.jsonl`` (its ``{rank}`` stays) and
    ``metrics.tensorboard_dir``.
    """
    base = PurePosixPath(base_dir)
    if not base.is_absolute():
        raise field_error("base_dir", str(base_dir), "must be an absolute directory")
    model = config.model
    if isinstance(model, SpecFileModel | HuggingFaceModel) and model.path is not None:
        model = model.model_copy(update={"path": _anchored(base, model.path)})
    data = config.data
    if isinstance(data, IndexedData):
        data = data.model_copy(
            update={
                "prefix": _anchored(base, data.prefix),
                "manifest": _anchored(base, data.manifest),
            }
        )
    ckpt = config.checkpoint.model_copy(update={"dir": _anchored(base, config.checkpoint.dir)})
    m = config.metrics
    metrics = m.model_copy(
        update={
            "jsonl": _anchored(base, m.jsonl),
            "tensorboard_dir": _anchored(base, m.tensorboard_dir),
        }
    )
    return config.model_copy(
        update={"model": model, "data": data, "checkpoint": ckpt, "metrics": metrics}
    )
