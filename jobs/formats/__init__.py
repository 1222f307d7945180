"""Foreign file formats in and out: OpenAI batch files."""
