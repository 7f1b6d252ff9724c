"""S3 and local-folder batch I/O: stream JSONL input lines, validate them, write OpenAI-shaped results,
errors and a manifest. No database and no HTTP here; the batch pipeline wires these to the store."""
