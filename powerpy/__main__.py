import sys

from powerpy.cli import main

sys.exit(main())
