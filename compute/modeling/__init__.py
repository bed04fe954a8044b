"""The model: its config, decoder and attention, the batch a forward step takes, the paged KV cache, the tokenizer
and the lazy weight injector that fills it from the parameter store."""
