"""Data: the synthetic language pair, repeated tokens, text, parallel text, packing."""
