"""Running JSONL batches next to an engine: the runner and finalizer drive a batch through the store; the rest
is S3 and local-folder I/O with no database and no HTTP.

runner         leases batches, reads chunks of lines, commits lines and jobs, publishes the jobs
finalize       writes a finished batch's outputs and closes it in the store
reader         stream (line_number, raw bytes) from S3 or a local file, resumable at a ReadPosition
source         open a batch's input where its reading stopped
lines          validate one line into a BatchRequest (engine SamplingParams kwargs) or a LineError
prompt_length  the prompt-length counter for LineLimits over the engine tokenizer
writer         results / errors JSONL and manifest JSON under an S3 prefix (multipart) or a local folder
manifest       counts, token totals and timings
(S3 URLs and the client are core/s3.py; the OpenAI line shapes core/views/openai_objects.py.)
"""
