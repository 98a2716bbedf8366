"""`python -m loopserve ...`: the `loopserve` command (`loopserve.cli`)."""

import sys

from loopserve.cli import main

if __name__ == "__main__":  # (not when multiprocessing's spawn imports this module as `__mp_main__`)
    sys.exit(main())
