"""`python -m flexpar.cli`: the same command line as `flexpar` and `python -m flexpar`."""

import sys

from flexpar.cli import main

sys.exit(main())
