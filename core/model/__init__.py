"""The target model: loading it (the embedded default, transformers directories, GGUF files;
:mod:`.loading`), its unmodified transformers forward over the paged KV cache
(:mod:`.target`), and its quantized linear layers (:mod:`.quantization`; a GGUF file's own
blocks in :mod:`.gguf_blocks`)."""
