"""Job kinds beyond plain generation: scoring, structured output, eval metrics, reasoning blocks."""
