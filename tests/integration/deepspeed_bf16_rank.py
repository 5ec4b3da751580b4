"""One DeepSpeed adapter rank in bf16 with Sailor's checkpoints, on the CPU (tests only).

The adapter's rule runs fp32 on the CPU (gloo); DeepSpeed's CPU accelerator runs bf16 (its
``BF16_Optimizer``), not fp16 (``Type fp16 is not supported on your device``), so the tests
of bf16 checkpoints start their ranks here: ``deepspeed_glue``'s entry point, in bf16.
"""

from __future__ import annotations

import os

from sailor.megatron_patch.deepspeed_adapter import main
from sailor.training_process.deepspeed_glue import DeepSpeedLayerIO
from tests.integration.rank_exit import exit_now

if __name__ == "__main__":
    # DeepSpeed's BF16_Optimizer imports its Muon optimizer, whose functions are wrapped in
    # torch.compile at import: that imports inductor (~1.3 s of CPU a rank), for functions
    # this run never calls; compile wrappers are then no-ops (deepspeed_fault_rank too)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    exit_now(main(ckpt=DeepSpeedLayerIO(), precision="bf16"))
