"""Target hidden states kept slot by slot beside the K/V, so prefix caching serves them too.

Drafters with a KV cache of their own over the prompt (EAGLE, MTP) read the target's hidden
states of every prompt token. A prompt prefix found in the prefix cache is not run through
the target again, so its states would be missing: the engine keeps each committed token's
states in the slot of its K/V (same block table, same lifetime, same reuse) and hands a
request whose prefix came from the cache the stored states of that prefix.
"""

from __future__ import annotations

import torch

from .zeroed import zeroed


class HiddenStateCache:
    """Hidden states of the captured target layers, ``[num_blocks * block_size, hidden]`` each."""

    def __init__(self, layers: list[int], num_slots: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.states = {layer: zeroed((num_slots, hidden_size), dtype, device) for layer in layers}

    @staticmethod
    def bytes_per_token(num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
        return num_layers * hidden_size * torch.empty((), dtype=dtype).element_size()

    def write(self, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        """Store ``hidden[layer][i]`` in slot ``slots[i]`` of every layer."""
        for layer, store in self.states.items():
            store.index_copy_(0, slots, hidden[layer].to(store.dtype))

    def read(self, slots: torch.Tensor) -> dict[int, torch.Tensor]:
        """The stored states of ``slots``, layer -> ``[len(slots), hidden]``."""
        return {layer: store.index_select(0, slots) for layer, store in self.states.items()}
