"""Multi-token prediction (``model.mtp_depth``; NCP-ArchPreview Sec. 5.2): module.py, config.py."""
