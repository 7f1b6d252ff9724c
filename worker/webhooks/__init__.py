"""Webhook sending: the address-pinning transport, the retry schedule, one delivery attempt and the sender
loop. What it shares with the API and the store (events, signing, the SSRF policy, the attempt record) is
in core/webhooks."""
