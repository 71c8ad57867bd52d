"""Data: corpus sources, tokenization, Megatron indexed datasets, training windows.

Submodules are imported explicitly (``from ncpctl.data.indexed import IndexedDataset``)
so that importing one does not pull in the others' dependencies.
"""
