"""The training studies: ``tuned`` (every method at its own learning rate), ``width`` (the width and compute fronts),
``llm`` (decoder pre-training at equal tokens or seconds), ``common`` (what they share), ``driver`` (the study file and
run loop of ``tuned`` and ``width``) and ``report`` (their tables and figures in docs/results.md)."""
