"""The request protocol: every rule a request is judged by, whichever door it came in by (POST /v1/jobs, the
OpenAI and vLLM routes, a batch line), and the one typed model of a job's parameters. Pure rules on plain
data: the API answers a refusal as its HTTP error, a batch line as its error line."""
