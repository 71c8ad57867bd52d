"""NCP-ArchPreview's block-parallel drafter (Sec. 5.3): module.py. Its training hooks are
ncpctl/train/designs/drafter.py (``ncpctl train-drafter``)."""
