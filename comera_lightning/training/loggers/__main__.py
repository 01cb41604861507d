"""``python -m comera_lightning.training.loggers upload <folder>``: the old command, now
``python -m comera_lightning.loggers upload <folder>``."""

from comera_lightning.loggers.fallback import main

if __name__ == "__main__":
    main()
