"""``python -m sailor.training_process ARGS``: one rank of a plan, as the agent launches it."""

import sys

from sailor.training_process.entry import main

sys.exit(main())
