"""``python -m comera_lightning`` is the ``comera`` command."""

from .cli import main

main()
