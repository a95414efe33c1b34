"""Print the header, key/values and tensor table of a GGUF or PowerInfer (PWRI) file.

Usage: python tools/dump_gguf.py FILE [--kv-only | --tensors-only] [--max-items N]
Same as `powerpy dump`; understands PWRI models and .generated.gpuidx files (I32 = id 18).
"""

from __future__ import annotations

import sys

try:
    from powerpy.commands.dump import main
except ImportError:  # run from a source checkout without `pip install -e .`
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from powerpy.commands.dump import main

if __name__ == "__main__":
    sys.exit(main())
