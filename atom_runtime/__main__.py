"""`python -m atom_runtime ...` is `atom-run ...` (for hosts where the console script is not installed)."""

from atom_runtime.cli import main

main()
