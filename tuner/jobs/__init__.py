"""One job per command that writes: optimize (staging, atomic swap), pipeline (its steps),
variants (build and gate each variant), pad. Jobs compose the stages; only cli/ calls them."""
