"""``python -m solver``: PowerInfer-compatible ``python -m powerinfer`` (see ``solver.cli``)."""

from __future__ import annotations

import sys

from solver.cli import main

sys.exit(main())
