"""``python -m sims.calibrate``: the ``flowtrain calibrate`` command."""

import sys

from sims.calibrate.command import main

sys.exit(main())
