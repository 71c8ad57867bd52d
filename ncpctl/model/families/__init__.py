"""The backbone families (neox, gpt2, llama): one module each, and the HF mapping."""
