"""What clients see: a job's and a batch's public shape (the body of a `GET` and the `data` of a webhook
event), OpenAI's response objects, embeddings as they are sent, and tool calls read out of a chat job's
text."""
