"""The draft side: what drafters and the core hand each other (:mod:`.interface`), the hooks
every method implements (:mod:`.hookspecs`), draft trees (:mod:`.tree`,
:mod:`.tree_expansion`), and the machinery the methods share: a draft module batched over
requests on its own paged KV cache (:mod:`.runner`), checkpoints that share the target's
embeddings and head (:mod:`.checkpoint`), the drafters that read the target's features
(:mod:`.feature_drafter`: EAGLE, MTP) or its last hidden state (:mod:`.last_state`: Medusa,
ReDrafter), and their common layers (:mod:`.layers`). Plugins reach all of it through
:mod:`specdec.plugin_api`."""


def __getattr__(name: str):  # the names of the old module, for one release
    from .._moved import moved_attribute

    return moved_attribute(__name__, name)
