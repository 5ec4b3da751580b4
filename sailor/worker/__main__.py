"""``python -m sailor.worker ARGS``: deprecated alias of ``python -m sailor.training_process``."""

import sys

from sailor.training_process import main

sys.exit(main())
