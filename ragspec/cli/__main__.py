"""`python -m ragspec.cli ...`: the same command line as the `ragspec` script."""

from ragspec.cli import main

main()
