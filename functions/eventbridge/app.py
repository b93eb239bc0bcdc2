"""EventBridge channel function: publishes claimed messages as events with PutEvents."""

from outbox.runtime import channel_handler

# Settings are checked here, at cold start; the sender runtime does the rest.
handler = channel_handler("eventbridge")
