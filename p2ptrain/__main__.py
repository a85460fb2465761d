"""``python -m p2ptrain``: see ``p2ptrain.commands.cli``."""

import sys

from p2ptrain.commands.cli import main

sys.exit(main())
