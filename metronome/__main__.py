"""``python -m metronome``: the ``metronome`` command."""

import sys

from metronome.cli.main import main

sys.exit(main())
