"""Measure: honest timing and what is decided from it.

stats (summaries, paired-ratio intervals), timing (interleaved rounds), bench (variants x shapes
through the results cache), select (keep the original unless a win is beyond noise), buckets
(the request-length distribution -> bucket sets), cache (timings kept across runs)."""
