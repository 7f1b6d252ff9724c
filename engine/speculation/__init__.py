"""Speculative decoding: cheap drafts of a request's next tokens, verified by the model in the engine's one
flattened step, so a step that reads the weights once can emit several tokens per request.

- config.py: SpeculativeConfig (EngineConfig.speculative): method, draft lengths, when to stop proposing.
- ngram.py and suffix.py: the proposers, one state per request, fed the request's tokens as they grow.
- step_cost.py: the measured cost of a step by its token count, which decides whether drafts pay.
- speculator.py: the scheduler's side: drafts per request, capped by budget, acceptance and cost.
- verification.py: the engine's side: the rows each draft is scored by, the tokens accepted (greedy and
  sampled requests keep exactly the distribution plain decoding gives), the sequence rolled back to them.
"""
