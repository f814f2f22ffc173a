"""``python -m scratchlm.train --config ...``: the same as ``scratchlm train`` (what torchrun launches)."""

from __future__ import annotations

import sys

from scratchlm.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["train", *sys.argv[1:]]))
