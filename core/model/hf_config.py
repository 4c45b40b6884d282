"""The language model's part of a transformers config: a multimodal or composite model keeps
its text settings (layers, heads, vocabulary) in a sub-config, which ``get_text_config``
returns; older configs have none and are their own text config."""


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config
