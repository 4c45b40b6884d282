"""How the target computes, where a choice changes bits or speed: batch-invariant linear
layers (:mod:`.invariant`; the attention's reference is
:mod:`specdec.kernels.invariant_attention`), and the resolution of every ``auto`` setting
(quantization, compile, batch invariance) in one place (:mod:`.auto`)."""
