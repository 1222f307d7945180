"""Rows in: input files and their fingerprints, prompts, the tokenizer, each unit's input columns."""
