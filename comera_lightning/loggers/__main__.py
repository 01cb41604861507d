"""``python -m comera_lightning.loggers upload <folder>``: see :func:`.fallback.main`."""

from .fallback import main

if __name__ == "__main__":
    main()
