"""Where a model's files come from: a local Hugging Face folder, a GGUF file, a Hugging Face hub id, a model
shipped inside an installed Python package, or a random-weight preset. Each is made a local Hugging Face
folder (config.json, tokenizer files) that the API's tokenizer and the engine's loader read.

This package is the bottom of the house and imports no torch: the API uses it for the tokenizer alone
(`model_files`); the engine adds the weights (engine/model_source.py).
"""
