"""What the API and the workers share: settings, the store (the source of truth), the domain rules (statuses,
views, webhook events and signing, the SSRF guard, OpenAI shapes) and the seams the two processes talk
through (the publisher, the broker's queues, the token stream).

Imports neither `api`, `worker` nor `engine`, and no HTTP framework or torch: both processes stand on it.
"""
