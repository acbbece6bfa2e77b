"""The benchmark scripts import each other and ``benchmarks/common.py`` as top-level modules, as
they do when run as ``python benchmarks/X.py`` (the script's folder first on ``sys.path``); the
tests import them the same way, from that folder put on ``sys.path`` here, once."""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
