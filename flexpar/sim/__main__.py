"""``python -m flexpar.sim SCENARIO.toml``: the simulator without the flexpar CLI."""

import sys

from .cli import main

sys.exit(main())
