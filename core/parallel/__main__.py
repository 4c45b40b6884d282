"""``python -m specdec.parallel``: a worker rank started by rank 0 (:func:`.worker.main`)."""

from ..process_exit import exit_now
from .worker import main

exit_now(main())
