"""The tensor-parallel group: processes, process groups, the wire from rank 0, faults.

Rank 0 owns everything but a shard of the target: the API, scheduling, drafting, acceptance.
On one machine it starts ranks ``1 .. N-1`` itself (forks of a process that imported the
worker once, killed with it: :mod:`.launch`); under ``torchrun`` every rank runs the user's
program and ranks other than 0 turn into workers inside ``LLM()``. Two process groups: the
target's own collectives (NCCL on GPUs, gloo on CPUs) and a gloo group on which rank 0 sends
its operations (:mod:`.messages`), both with ``engine.distributed_timeout_s`` on every
collective. Liveness is not asked on that wire: a rank busy with a long operation cannot
take a message, yet it is alive. Each rank's watch thread ticks a counter in the group's
store and reads its peers'; a worker whose counter stands still for the timeout (it died or
was stopped) turns every later call into a :class:`WorkerError` naming it, and a worker
whose rank 0 stands still exits. A waiting worker waits as long as rank 0 lives.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import json
import logging
import os
import pickle
import socket
import subprocess
import tempfile
import threading
import time
from importlib.metadata import entry_points, version

import torch
import torch.distributed as dist

from ..errors import ConfigError, SpecdecError
from .launch import WorkerProcess, start_worker
from .messages import Fingerprint, Shutdown

log = logging.getLogger(__name__)

#: set in a worker started by rank 0: the file holding the configuration it runs
CONFIG_ENV = "SPECDEC_TP_CONFIG"

#: bytes of the first broadcast of each operation: its length and, for one step's (1.6 KB at
#: batch 1, 3.8 KB at batch 8), all of it
HEADER_BYTES = 8192

#: numbers the groups of one torchrun program, so that several (one per LLM) share its store
_GROUPS = itertools.count()
#: what a failure while the ranks meet, and while they load their shards, is reported as
STARTING = "starting the group"
LOADING = "loading the target"
WATCHING = "rank 0 watched it between operations"
#: the least time the ranks are given to meet: a worker process imports torch and specdec
#: first, which takes longer than a short ``distributed_timeout_s`` on a loaded machine
JOIN_TIMEOUT_S = 60.0
#: how long a worker's receive waits for rank 0's next operation: without end in practice,
#: since the watch thread, not this timeout, finds a rank 0 that is gone
IDLE_WAIT = datetime.timedelta(days=365)


class WorkerError(SpecdecError):
    """A tensor-parallel worker died or stopped answering; the engine cannot go on."""


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` (or similar) launch, not a worker
    rank 0 started."""
    launch = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return CONFIG_ENV not in os.environ and all(name in os.environ for name in launch)


def threads_per_rank(config) -> int:
    """Torch threads of each rank: ``engine.num_threads``, else the machine's cores shared out."""
    return config.engine.num_threads or max(1, (os.cpu_count() or 1) // config.engine.tensor_parallel_size)


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plugins() -> tuple[str, ...]:
    return tuple(sorted(f"{ep.name}={ep.value}" for ep in entry_points(group="specdec.plugins")))


class TensorParallelGroup:
    """This process's place in the group. Rank 0 calls :meth:`send`; workers :meth:`receive`."""

    def __init__(self, rank: int, size: int, device: torch.device, timeout_s: float,
                 workers: list[WorkerProcess] | None = None):
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout_s = timeout_s
        self._join_timeout_s = max(timeout_s, JOIN_TIMEOUT_S)
        self.workers = workers or []
        self.failure: WorkerError | None = None
        self.peers: list[tuple[str, int]] = []  # (host, pid) of each rank
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None
        self._watch_error: Exception | None = None
        self._moved: dict[int, float] = {}  # peer -> when its counter last moved
        self._address: tuple[str, int] | None = None
        #: how often the watch ticks and the judge looks: a stopped peer is found within
        #: ``distributed_timeout_s`` plus this
        self._tick_s = max(0.1, timeout_s / 8)
        self._closed = False
        self.forward_group = None
        self.plan_group = None
        #: seconds this rank spent sending operations (rank 0) and in the forward's
        #: all-reduces: what tensor parallelism adds to a step (scripts/bench_tensor_parallel.py)
        self.send_seconds = 0.0
        self.collective_seconds = 0.0

    # -- starting ----------------------------------------------------------------------

    @classmethod
    def start(cls, config, device: torch.device) -> TensorParallelGroup:
        """Join (rank > 0 under torchrun) or start (rank 0) the group of ``config``'s size."""
        from ..config_loading import unstructure

        size = config.engine.tensor_parallel_size
        timeout = config.engine.distributed_timeout_s
        workers, config_file = [], None
        if launched_by_torchrun():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if world != size:
                raise ConfigError(f"engine.tensor_parallel_size: {size}, but torchrun started {world} processes; "
                                  f"launch as many processes as the size (--nnodes x --nproc-per-node = {size})")
            address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        elif os.environ.get(CONFIG_ENV):
            rank, address, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            local_rank = rank
        else:
            rank, local_rank, address, port = 0, 0, "127.0.0.1", free_port()
            workers, config_file = cls._launch_workers(unstructure(config), size, port)
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        group = cls(rank, size, device, timeout, workers)
        try:
            with group.guard(STARTING):
                group._init(address, port, config)
        except BaseException:
            group.close()
            raise
        finally:
            if config_file is not None:  # the workers read it before they join
                os.unlink(config_file)
        return group

    @staticmethod
    def _launch_workers(config: dict, size: int, port: int) -> tuple[list[WorkerProcess], str]:
        """Ranks ``1 .. size-1`` on this machine, and the file their configuration is in."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="specdec-tp-", delete=False) as f:
            json.dump(config, f)
        workers = []
        for rank in range(1, size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), **{CONFIG_ENV: f.name})
            for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
                env.pop(name, None)
            try:
                workers.append(start_worker(env))
            except (OSError, ChildProcessError) as exc:
                for worker in workers:
                    worker.kill()
                os.unlink(f.name)
                raise WorkerError(f"could not start tensor-parallel rank {rank}: {exc}") from exc
        return workers, f.name

    def _init(self, address: str, port: int, config) -> None:
        from ..config_loading import unstructure

        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._address = (address, port)
        # torchrun's agent keeps the store the ranks meet at; otherwise rank 0 holds it
        master = self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self._store = dist.TCPStore(address, port, self.size, is_master=master,
                                    timeout=datetime.timedelta(seconds=self._join_timeout_s))
        self._store.set_timeout(timeout)
        self._prefix = prefix = f"specdec-tp-{next(_GROUPS)}" if launched_by_torchrun() else "specdec-tp"
        self.plan_group = _gloo(dist.PrefixStore(f"{prefix}/plan", self._store), self.rank, self.size, timeout)
        backend = _nccl if self.device.type == "cuda" else _gloo
        self.forward_group = backend(dist.PrefixStore(f"{prefix}/forward", self._store), self.rank, self.size, timeout)
        # every rank leaves its groups before the interpreter is torn down, which aborts a
        # process whose gloo threads are still running ("terminate called without an
        # active exception")
        atexit.register(self.close)
        mine = Fingerprint(config=unstructure(config), plugins=_plugins(), specdec_version=version("specdec"))
        prints = self._gather((mine, socket.gethostname(), os.getpid()))
        self.peers = [(host, pid) for _, host, pid in prints]
        verdict = self._broadcast(_mismatch(prints[0][0], [p[0] for p in prints]) if self.rank == 0 else None)
        if verdict:
            raise ConfigError(verdict)

    def loaded(self) -> None:
        """Every rank calls this once its shard is loaded; it returns when all have. Ranks
        load at their own pace (a loaded machine, a slower disk), so the wait is the join
        timeout, not ``distributed_timeout_s``, and the ranks watch each other only after it."""
        store = dist.PrefixStore(f"{self._prefix}/loaded", self._store)
        store.set(str(self.rank), "1")
        keys = [str(rank) for rank in range(self.size)]
        deadline = time.monotonic() + self._join_timeout_s
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=0.5))
                break
            except RuntimeError as exc:
                if time.monotonic() > deadline or any(proc.poll() is not None for proc in self.workers):
                    raise self._fail(LOADING, exc) from exc
        self._moved = dict.fromkeys(range(1, self.size) if self.rank == 0 else [0], time.monotonic())
        self._watch = threading.Thread(target=self._watch_peers, name="specdec-tp-watch", daemon=True)
        self._watch.start()
        threading.Thread(target=self._judge, name="specdec-tp-judge", daemon=True).start()

    def _broadcast(self, message, timeout: datetime.timedelta | None = None):
        """Rank 0's ``message`` on every rank, pickled: one broadcast of :data:`HEADER_BYTES`
        holding its length and, for a step's operations, all of it; a second for the rest of
        a longer one. ``timeout`` replaces the group's for the first."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if timeout is not None:
            options.timeout = timeout
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            data = pickle.dumps(message)
            header[:8] = torch.tensor([len(data)]).view(torch.uint8)
            first = data[:HEADER_BYTES - 8]
            header[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self.plan_group.broadcast([header], options).wait()
        if timeout is not None:
            options.timeout = datetime.timedelta(seconds=self.timeout_s)
        length = int(header[:8].view(torch.int64))
        rest = b""
        if length > HEADER_BYTES - 8:
            tail = (torch.frombuffer(bytearray(data[HEADER_BYTES - 8:]), dtype=torch.uint8) if self.rank == 0
                    else torch.empty(length - (HEADER_BYTES - 8), dtype=torch.uint8))
            self.plan_group.broadcast([tail], options).wait()
            rest = tail.numpy().tobytes()
        if self.rank == 0:
            return message
        return pickle.loads(header[8:8 + length].numpy().tobytes() + rest)

    def _gather(self, mine) -> list:
        """Every rank's ``mine``, in rank order, on every rank."""
        data = pickle.dumps(mine)
        lengths = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        self.plan_group.allgather([lengths], [torch.tensor([len(data)])]).wait()
        longest = int(max(lengths))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.plan_group.allgather([buffers], [padded]).wait()
        return [pickle.loads(b[:int(n)].numpy().tobytes()) for b, n in zip(buffers, lengths)]

    # -- rank 0 ------------------------------------------------------------------------

    def send(self, message) -> None:
        """Send one operation to every worker (rank 0); a :class:`WorkerError` if one is gone."""
        self.check()
        started = time.perf_counter()
        with self._lock, self.guard("sending an operation"):
            self._broadcast(message)
        self.send_seconds += time.perf_counter() - started

    def check(self) -> None:
        """Raise the group's failure, if it failed."""
        if self.failure is not None:
            raise self.failure

    @contextlib.contextmanager
    def guard(self, what: str):
        """Around a collective call (nothing else: gloo reports a lost peer as a bare
        RuntimeError): its error becomes the group's :class:`WorkerError`."""
        self.check()
        try:
            yield
        except RuntimeError as exc:
            raise self._fail(what, exc) from exc

    def _fail(self, what: str, exc: BaseException) -> WorkerError:
        if self.failure is None:
            dead = self._dead_ranks()
            if dead:
                who = ", ".join(f"rank {r} ({reason})" for r, reason in dead)
                text = f"tensor-parallel worker {who} is gone while {what}"
            elif what in (STARTING, LOADING):
                text = (f"a tensor-parallel worker (ranks 1..{self.size - 1}) did not join within "
                        f"{self._join_timeout_s:g} s while {what}")
            else:
                text = (f"a tensor-parallel worker (ranks 1..{self.size - 1}) did not answer within "
                        f"engine.distributed_timeout_s = {self.timeout_s:g} s while {what}")
            self.failure = WorkerError(f"{text}; the engine cannot continue: restart it "
                                       f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            log.error("%s", self.failure)
        return self.failure

    def _dead_ranks(self) -> list[tuple[int, str]]:
        deadline = time.monotonic() + 1.0
        while True:
            dead = []
            for rank, proc in enumerate(self.workers, start=1):
                code = proc.poll()
                if code is not None:
                    dead.append((rank, f"exited with {code}" if code >= 0 else f"killed by signal {-code}"))
            if not self.workers:
                host = socket.gethostname()
                for rank, (peer_host, pid) in enumerate(self.peers[1:], start=1):
                    if peer_host == host and not _alive(pid):
                        dead.append((rank, "its process is gone"))
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def _watch_peers(self) -> None:
        """Tick this rank's counter in the store and read the peers' (rank 0 reads every
        worker's, a worker rank 0's) until closed, noting when each last moved. The store's
        calls block without end on a stopped rank 0 that holds it, so a second thread
        (:meth:`_judge`) decides, on these notes alone."""
        try:
            store = dist.PrefixStore(f"{self._prefix}/alive", dist.TCPStore(
                *self._address, is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s),
                wait_for_workers=False))
            counts = dict.fromkeys(self._moved, -1)
            while not self._stop.wait(self._tick_s):
                store.add(str(self.rank), 1)
                for peer in counts:
                    count = store.add(str(peer), 0)
                    if count != counts[peer]:
                        counts[peer], self._moved[peer] = count, time.monotonic()
        except Exception as exc:  # noqa: BLE001 - a lost store: the judge finds the peers still
            self._watch_error = exc

    def _judge(self) -> None:
        """A peer whose counter stood still for ``distributed_timeout_s``, or a started
        worker that exited, is gone: rank 0 fails the group; a worker leaves its process,
        since its receive cannot be interrupted."""
        while not self._stop.wait(self._tick_s):
            now = time.monotonic()
            still = [peer for peer, moved in self._moved.items() if now - moved > self.timeout_s]
            exited = [rank for rank, proc in enumerate(self.workers, start=1) if proc.poll() is not None]
            if not still and not exited:
                continue
            if self._stop.wait(0 if self.rank == 0 else 1.0):  # a worker's Shutdown may be on its way
                return
            reason = (ChildProcessError(f"rank {exited[0]} exited") if exited else self._watch_error or
                      TimeoutError(f"rank {still[0]}'s counter stood still for {self.timeout_s:g} s"))
            if self.rank == 0:
                self._fail(WATCHING, reason)
                return
            log.error("rank %d stops: rank 0 did not answer within engine.distributed_timeout_s = %g s (%s: %s)",
                      self.rank, self.timeout_s, type(reason).__name__, reason)
            os._exit(1)

    def close(self) -> None:
        """Stop the workers (rank 0) and leave the process groups; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watch is not None:
            self._watch.join(timeout=5)
        if self.rank == 0 and self.failure is None and self.plan_group is not None:
            try:
                with self._lock:
                    self._broadcast(Shutdown())
            except Exception:  # noqa: BLE001 - the workers are killed below regardless
                pass
        for proc in self.workers:
            try:
                proc.wait(timeout=10 if self.failure is None else 0.5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for group in (self.forward_group, self.plan_group):
            if group is not None:
                (group.abort if self.failure is not None else group.shutdown)()
        self.forward_group = self.plan_group = self._store = None
        atexit.unregister(self.close)

    # -- workers -----------------------------------------------------------------------

    def receive(self):
        """The next operation from rank 0 (a worker); raises when rank 0 is gone."""
        message = self._broadcast(None, IDLE_WAIT)
        if isinstance(message, Shutdown):
            self._stop.set()  # rank 0 may leave the store now: the watch must not take it for gone
        return message


def _gloo(store, rank: int, size: int, timeout: datetime.timedelta):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _nccl(store, rank: int, size: int, timeout: datetime.timedelta):
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mismatch(reference: Fingerprint, prints: list[Fingerprint]) -> str | None:
    """A message naming the first rank whose fingerprint differs from rank 0's, or None."""
    for rank, other in enumerate(prints):
        if other == reference:
            continue
        if other.specdec_version != reference.specdec_version:
            what = f"specdec {other.specdec_version} against {reference.specdec_version}"
        elif other.plugins != reference.plugins:
            what = (f"installed plugins {sorted(set(other.plugins) ^ set(reference.plugins))} differ")
        else:
            what = "configuration " + ", ".join(_differences(reference.config, other.config))
        return (f"engine.tensor_parallel_size: rank {rank} does not run what rank 0 runs ({what}); start every "
                "rank with the same model, options and plugins")
    return None


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}: {y!r} on that rank, {x!r} on rank 0")
    return out
