"""Memory per process kind of a command's whole process tree (issue 39: every process under 40 MB).

Run: `python benchmarks/footprint.py [--json] [--period 0.5] -- fog-agent demo --json --quiet --no-analytics`
(the sampler is foglab.tools.footprint, which the demo also runs on its own tree).
"""

import sys

from foglab.tools.footprint import main

if __name__ == "__main__":
    sys.exit(main())
