"""`python -m neuronpy.bench [flags]`: the same as `neuronpy bench [flags]`."""

from __future__ import annotations

import argparse
import logging
import sys

from neuronpy.bench.cli import DESCRIPTION, add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m neuronpy.bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args, sys.argv[1:])


raise SystemExit(main())
