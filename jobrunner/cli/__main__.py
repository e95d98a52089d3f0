"""`python -m jobrunner.cli ...`: the CLI without the `jobrunner` script on PATH (used by `jobrunner submit`)."""

from jobrunner.cli import main

if __name__ == "__main__":
    main()
