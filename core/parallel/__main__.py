"""``python -m specdec.parallel``: a worker rank started by rank 0 (:func:`.worker.main`)."""

import sys

from .worker import main

sys.exit(main())
