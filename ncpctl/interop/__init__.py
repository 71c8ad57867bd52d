"""Hugging Face interop: ``export`` (a complete, self-checked HF directory) and
``load_hf_pretrained`` (an HF directory -> NCPModel, optionally with a fresh concept path)."""
