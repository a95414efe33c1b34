"""``python -m solver``: upstream's ``python -m powerinfer`` (powerpy.commands.solve_gpuidx)."""

import sys

from powerpy.commands.solve_gpuidx import main

sys.exit(main())
