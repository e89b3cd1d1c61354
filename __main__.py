"""``python -m capuchin ...``: the ``capuchin`` command (also under ``torchrun -m capuchin``)."""

from .cli import main

main(prog_name="capuchin")
