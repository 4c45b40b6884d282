"""``python -m specdec.parallel``: the launcher rank 0 forks its workers from (:mod:`.launch`)."""

from ..process_exit import exit_now
from .launch import serve

serve()
exit_now(0)
