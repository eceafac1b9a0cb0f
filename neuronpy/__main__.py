"""`python -m neuronpy serve`: the same as the `neuronpy` command."""

from neuronpy.cli import main

raise SystemExit(main())
