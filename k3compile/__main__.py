"""`python -m k3compile ...`: the command line (what torch.distributed.run starts in each process)."""

import sys

from k3compile.cli import main

if __name__ == "__main__":
    sys.exit(main())
