import sys

from flexpar.cli import main

sys.exit(main())
