"""``python -m sailor.worker ARGS``: one rank of a plan, as the agent launches it."""

import sys

from sailor.worker.entry import main

sys.exit(main())
