"""`python -m kvwire.cli`: the `kvwire` command."""
import sys

from . import main

sys.exit(main())
