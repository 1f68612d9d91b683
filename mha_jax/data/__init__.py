"""Data: the synthetic language pair, repeated tokens, text, parallel text, packing, and an
imported run's tokenizer (tokenizer_json)."""
