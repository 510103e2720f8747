"""`python -m shardserve ...`: the same command line as the `shardserve` console script."""
import sys

from shardserve.cli import main

if __name__ == "__main__":   # spawned worker processes import this module as __mp_main__: run nothing
    sys.exit(main())
