"""`python -m gpullm_lessons.bench WHAT`: the benchmarks' command line (bench/kernels.py, main)."""

import sys

from .kernels import main

sys.exit(main())
