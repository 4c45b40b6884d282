"""Options of the whole test suite (tests, plugins, examples)."""

import contextlib
import gc
import os

import pytest
import torch

# Under pytest-xdist (``-n N``) each worker gets its share of the cores, so that N workers
# do not oversubscribe them; alone, the suite takes two threads, as CI's machine has. The
# processes a worker starts (servers, the CLI, training scripts) inherit its share through
# OMP_NUM_THREADS, so that they do not oversubscribe the cores either.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads = max(1, min(2, os.cpu_count() or 1) // _workers)
torch.set_num_threads(_threads)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cuda-graphs", action="store_true",
                     help="every engine on a CUDA target replays CUDA graphs (engine.cuda_graphs) where its "
                          "config allows them: the suite run through the graphed forward on a GPU")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--cuda-graphs"):
        return
    import attrs

    from specdec.errors import ConfigError
    from specdec.executor import engine

    build = engine.Engine.__init__

    def graphed(self, target, config, *args, **kwargs):
        if target.device.type == "cuda":
            with contextlib.suppress(ConfigError):  # options that rule graphs out keep them off
                config = attrs.evolve(config, cuda_graphs=True)
        build(self, target, config, *args, **kwargs)

    engine.Engine.__init__ = graphed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a test file's last test (its fixtures gone): collect and hand the freed heap
    back to the system. Without it glibc kept what the file's models freed, and a worker
    that had run many files held 10-14 GB, two of them and the servers they start near the
    24 GB of CI's machine (one was killed there)."""
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    from specdec.model.quantization import release_freed_memory

    gc.collect()
    release_freed_memory()
