"""The OpenAI-compatible HTTP server (`atom-run serve`)."""
