"""Options of the whole test suite (tests, plugins, examples)."""

import contextlib

import pytest


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
