"""``python -m p2ptrain``: see ``p2ptrain.cli``."""

import sys

from p2ptrain.cli import main

sys.exit(main())
