"""The project's own exception: a problem with the user's input, shown as one line.

The library raises it (and ValueError/OSError, which the CLI shows the same way) and the CLI prints it; it lives
here, not in cli.py, so that library modules never import the command-line layer.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (file, flag, value): printed as one clear line, no traceback."""
