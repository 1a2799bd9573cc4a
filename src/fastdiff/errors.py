"""User-facing errors: each carries one line that names the problem; the CLI prints it and exits with 2."""


class FastdiffError(Exception):
    """A problem with the user's input (a path, a flag, a config). The message is one line."""
