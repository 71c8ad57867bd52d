"""NCP-ArchPreview's depth mixers: IRC (``model.residual: irc``), Block AttnRes (``block_attnres``)
and the cross-module residual CRC (``model.crc``): module.py, config.py (their keys and costs)."""
