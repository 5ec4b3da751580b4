"""The toy trainer with a checkpoint storage that refuses one rank's optional saves.

``python -m tests.integration.save_fault_worker --fault-rank R ARGS`` runs
``sailor.agent.toy_trainer`` with ARGS; rank ``R``'s part of every optional save (a periodic
checkpoint's) is refused as by a failing storage (an ``OSError``, ``ENOSPC``): the rank gives
the save up and reports it (``save_failed``) through the toy's own path for a storage error,
with no branch for it in the toy. Required
saves (a reconfiguration's) and the other ranks' parts are not touched. Rank 0 (the toy's
committer) is the one to fault: the others' parts are written and they train on; a part of
another rank that never comes holds the committer for the toy's part timeout (30 s).
"""

from __future__ import annotations

import argparse
import errno
import sys
from typing import Any

from sailor.agent import toy_trainer


def _faulty(rank: int) -> Any:
    real = toy_trainer._save

    def save(root: str, step: int, w: list[float], r: int, *args: Any, **kw: Any) -> None:
        if r == rank and kw.get("optional"):
            raise OSError(
                errno.ENOSPC,
                f"injected: the checkpoint storage refused rank {r}'s part of step {step}",
            )
        real(root, step, w, r, *args, **kw)

    return save


def main() -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--fault-rank", type=int, required=True)
    known, rest = p.parse_known_args()
    toy_trainer._save = _faulty(known.fault_rank)  # type: ignore[assignment]
    return toy_trainer.main(rest)


if __name__ == "__main__":
    sys.exit(main())
