"""Reading what models come in: GGUF files (header, tensors, tokenizer), safetensors folders, tokenizers,
chat templates, and the process heap's freed pages."""
