"""Email channel function: delivers claimed messages through SES v2."""

from outbox.runtime import channel_handler

# Settings are checked here, at cold start; the sender runtime does the rest.
handler = channel_handler("email")
