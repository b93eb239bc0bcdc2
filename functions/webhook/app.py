"""Webhook channel function: delivers claimed messages as signed HTTPS webhooks."""

from outbox.runtime import channel_handler

# Settings are checked here, at cold start; the sender runtime does the rest.
handler = channel_handler("webhook")
