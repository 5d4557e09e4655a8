import sys

from orbitrl.cli import main

sys.exit(main())
