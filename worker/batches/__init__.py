"""S3 and local-folder batch I/O, with no database and no HTTP: the batch pipeline wires these to the store.

s3        `s3://` URL parsing and the boto3 client (credentials from the standard AWS chain only)
reader    stream (line_number, raw bytes) from S3 or a local file, resumable at a ReadPosition
lines     validate one line into a BatchRequest (engine SamplingParams kwargs) or a LineError
tokens    the prompt-length counter for LineLimits over the engine tokenizer
openai_format  chat.completion / text_completion bodies and batch output and error lines
writer    results / errors JSONL and manifest JSON under an S3 prefix (multipart) or a local folder
manifest  counts, token totals and timings
"""
