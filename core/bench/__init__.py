"""``specdec bench``: the runner (:mod:`.runner`), its built-in prompt sets
(:mod:`.prompt_sets`), and llama.cpp as comparison systems, native ``llama-server`` and
``llama-bench`` (:mod:`.llama_cpp_native`) and the Python bindings
(:mod:`.llama_cpp_bindings`)."""


def __getattr__(name: str):  # the names of the old module, for one release
    from .._moved import moved_attribute

    return moved_attribute(__name__, name)
