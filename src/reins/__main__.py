"""`python -m reins`: the `reins` command, for an environment whose scripts are not on PATH."""

from reins.cli import main

main()
