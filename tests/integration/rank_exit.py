"""How the test-only DeepSpeed rank programs end (``deepspeed_bf16_rank``, ``..._fault_rank``).

:func:`exit_now` ends the process with the adapter's exit status once ``main`` has returned,
without the interpreter's teardown: by then every file a test reads is written and closed
(progress lines are flushed as they go, the state dump and the save trace are closed, the
checkpointer is closed inside ``main``) and the ranks have passed their last barrier. The
teardown (the collection of torch's, DeepSpeed's and inductor's modules) cost ~1.3 s of CPU a
rank (measured: 4 bf16 ranks, 27.8 s of CPU with it, 22.7 s without), a fifth of a rank's
life, and these programs start ~20 ranks per test file. A failing rank never reaches it
(``main`` ends it with ``os._exit(1)`` itself). The shipped entry points
(``sailor.training_process.deepspeed_glue``, ``sailor.megatron_patch.deepspeed_adapter``,
run by test_deepspeed_checkpoints.py and test_megatron_patch_deepspeed.py) exit normally, so
a clean exit through the teardown is still tested there.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["exit_now"]


def exit_now(status: int) -> NoReturn:
    """Flush this process's output and end it with ``status``, skipping the teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
