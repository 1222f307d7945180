"""The output folder: its lock, parts and their records, resume, input-order output, statistics."""
