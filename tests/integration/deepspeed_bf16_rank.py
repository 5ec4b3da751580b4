"""One DeepSpeed adapter rank in bf16 with Sailor's checkpoints, on the CPU (tests only).

The adapter's rule runs fp32 on the CPU (gloo); DeepSpeed's CPU accelerator runs bf16 (its
``BF16_Optimizer``), not fp16 (``Type fp16 is not supported on your device``), so the tests
of bf16 checkpoints start their ranks here: ``deepspeed_glue``'s entry point, in bf16.
"""

from __future__ import annotations

from sailor.megatron_patch.deepspeed_adapter import main
from sailor.training_process.deepspeed_glue import DeepSpeedLayerIO
from tests.integration.rank_exit import exit_now

if __name__ == "__main__":
    exit_now(main(ckpt=DeepSpeedLayerIO(), precision="bf16"))
