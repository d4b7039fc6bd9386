"""`python -m qattn`: the qattn command line, for environments without the console script."""
from .cli import main

main(prog_name="qattn")
