"""What an abortable gloo wait keeps referenced once it is over (``sailor.comm.abort``).

A gloo work keeps the tensors it was posted with; the helper thread that waits on the works
(``abort.wait_threaded``) held the last one it had waited on until it was handed the next,
for good when no world came after it (a broken world's last all-reduce: its gradient
bucket). Run in a process of its own: one real gloo world of one rank.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    import torch, torch.distributed as dist
    from sailor.comm import abort, api as comm
    from sailor.localnet import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    abort.set_polling(True)
    bucket = torch.ones(1 << 20)
    ref = weakref.ref(bucket)
    comm.all_reduce(bucket)
    assert bucket[0].item() == 1.0
    del bucket
    gc.collect()
    print("kept" if ref() is not None else "freed", flush=True)
    abort.abandon_world(idle=True)
    """
)


def test_a_finished_abortable_wait_keeps_no_tensor(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "freed", out.stdout
