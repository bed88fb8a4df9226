"""``python -m aio_keuss worker ...``: the same as the ``aio-keuss`` command."""

import sys

from .worker.cli import main

sys.exit(main())
