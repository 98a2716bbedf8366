"""`python -m loopserve ...`: the `loopserve` command (`loopserve.cli`)."""

import sys

from loopserve.cli import main

sys.exit(main())
