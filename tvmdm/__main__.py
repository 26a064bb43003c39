"""python -m tvmdm: the command line."""
import sys

from tvmdm.cli.main import main

sys.exit(main())
