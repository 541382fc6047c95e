"""`python -m mpidist.cli ...`: the `mpidist` command."""
import sys

from .command import main

sys.exit(main())
