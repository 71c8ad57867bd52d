"""The staged model: config, layers, attention, RoPE, the concept path, outputs, decoding."""
