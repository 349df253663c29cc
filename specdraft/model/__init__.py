"""The target model: a lean Llama-family decoder, its loading (GGUF / HF folder) and its CPU kernels."""
