"""Webhook domain shared by the API, the store and the worker's sender: event types and filters, Standard
Webhooks signing, the SSRF policy, and the record of a delivery attempt. Sending lives in worker/webhooks."""
