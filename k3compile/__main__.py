"""`python -m k3compile ...`: the command line (what torch.distributed.run starts in each process)."""

import sys

from k3compile.cli import main

sys.exit(main())
