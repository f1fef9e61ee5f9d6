"""The ways a sandbox's read-only lower can be mounted (lowers.py says what each one does),
apart from lowers.py so that `weenv run --help` offers them without importing the mount
machinery (issue 13: parse and dispatch under 100 ms)."""

LOWER_MODES = ("layers", "merged")
DEFAULT_LOWER = "layers"
