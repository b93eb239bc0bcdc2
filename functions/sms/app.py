"""SMS channel function: delivers claimed messages through SNS (phone numbers)."""

from outbox.runtime import channel_handler

# Settings are checked here, at cold start; the sender runtime does the rest.
handler = channel_handler("sms")
