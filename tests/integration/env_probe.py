"""A stand-in worker that reports the environment it was started with.

``python -m tests.integration.env_probe --rank R --progress PATH [--hold] ...``: writes one
line ``{"event": "env", "rank", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}`` to the
progress path (``{rank}`` replaced) as the first thing it does, before it imports anything
of torch's, so the values are the ones its parent gave it; every other option is ignored.
With ``--hold`` it then sleeps until killed (under an agent's supervisor).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--hold", action="store_true")
    args, _ = p.parse_known_args()
    env = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    line = json.dumps({"event": "env", "rank": args.rank, **env})
    Path(args.progress.replace("{rank}", str(args.rank))).write_text(line + "\n")
    while args.hold:
        time.sleep(1)
