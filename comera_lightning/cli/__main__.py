"""``python -m comera_lightning.cli`` is the ``comera`` command."""

from . import main

main()
